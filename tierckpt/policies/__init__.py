"""Policies: small pure objects that decide what moves where and what is kept; they do no I/O.

* demotion (:mod:`tierckpt.policies.demotion`): which saves go down to a tier (every N, every T seconds,
  on close);
* retention (:mod:`tierckpt.policies.retention`): which copies a tier keeps, and the eviction safety rules;
* placement (:mod:`tierckpt.policies.placement`): :func:`place`, the one function that turns an event
  (save, prefetch, close, retention, a full tier) and the catalog into a plan the mover executes;
* the many-rank protocol (:mod:`tierckpt.policies.protocol`): every rank-wide decision about copies and
  commit records (a commit's outcome, who evicts which copies and records, orphans, unknown outcomes,
  world-size changes), as pure rules whose plans the rank executor carries out.
"""

from tierckpt.policies.demotion import AnyOf, Cadence, Demotion, DemotionRule, Every, EverySecs, Never
from tierckpt.policies.placement import (
    CatalogView,
    Close,
    Copy,
    CopyPlan,
    MakeRoom,
    Policy,
    Prefetch,
    Restored,
    Retain,
    RoomPlan,
    Save,
    SavePlan,
    Sent,
    place,
)
from tierckpt.policies.retention import (
    Held,
    KeepAll,
    KeepLatest,
    RetentionPlan,
    RetentionPolicy,
    capacity_victims,
    missing_tiers,
    plan_evictions,
    plan_retention,
)

__all__ = [
    "AnyOf",
    "Cadence",
    "CatalogView",
    "Close",
    "Copy",
    "CopyPlan",
    "Demotion",
    "DemotionRule",
    "Every",
    "EverySecs",
    "Held",
    "KeepAll",
    "KeepLatest",
    "MakeRoom",
    "Never",
    "Policy",
    "Prefetch",
    "Restored",
    "Retain",
    "RetentionPlan",
    "RetentionPolicy",
    "RoomPlan",
    "Save",
    "SavePlan",
    "Sent",
    "capacity_victims",
    "missing_tiers",
    "place",
    "plan_evictions",
    "plan_retention",
]
