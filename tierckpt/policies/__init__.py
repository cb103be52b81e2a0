"""Policies: small pure objects that decide what moves where and what is kept; they do no I/O.

* demotion (:mod:`tierckpt.policies.demotion`): which saves go down to a tier (every N, every T seconds,
  on close);
* retention (:mod:`tierckpt.policies.retention`): which copies a tier keeps, and the eviction safety rules.
"""

from tierckpt.policies.demotion import AnyOf, Cadence, Demotion, DemotionRule, Every, EverySecs, Never
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
    "Demotion",
    "DemotionRule",
    "Every",
    "EverySecs",
    "Held",
    "KeepAll",
    "KeepLatest",
    "Never",
    "RetentionPlan",
    "RetentionPolicy",
    "capacity_victims",
    "missing_tiers",
    "plan_evictions",
    "plan_retention",
]
