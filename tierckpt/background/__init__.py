"""The background machinery: what runs on the tiers' workers while training goes on.

* :mod:`~tierckpt.background.savejob` — one save: plan → stage → commit → demote;
* :mod:`~tierckpt.background.mover` — executes placement plans (:func:`tierckpt.policies.place`) on
  one :mod:`~tierckpt.background.worker` per tier;
* :mod:`~tierckpt.background.catalog` — what each tier holds, per step: states, pins, errors,
  demotion cadences; :mod:`~tierckpt.background.held` — copies kept beyond their window, and why;
* :mod:`~tierckpt.background.handles` (what ``save`` returns), :mod:`~tierckpt.background.pending`
  (work in flight), :mod:`~tierckpt.background.process` (the GC pause, the SIGTERM flush).

Imports only go down: the data path and the ranks, then tiers, format, io, policies.
"""
