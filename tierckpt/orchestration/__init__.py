"""The orchestration between the tiers: named objects, each concept in one module.

Read top-down from :class:`tierckpt.Hierarchy` (the facade) into:

* :mod:`~tierckpt.orchestration.savejob` — one save: plan → stage → commit → demote;
  :mod:`~tierckpt.orchestration.packing` — the tensors packed into a tier's blobs, the manifest built;
* :mod:`~tierckpt.orchestration.mover` — executes placement plans (:func:`tierckpt.policies.place`) on
  one :mod:`~tierckpt.orchestration.worker` per tier; :mod:`~tierckpt.orchestration.blobcopy` copies a
  checkpoint's blobs between two tiers;
* :mod:`~tierckpt.orchestration.catalog` — what each tier holds, per step: states, pins, errors,
  demotion cadences; :mod:`~tierckpt.orchestration.held` — copies kept beyond their window, and why;
* :mod:`~tierckpt.orchestration.restore` (fresh tensors), :mod:`~tierckpt.orchestration.restore_into`
  (in place), :mod:`~tierckpt.orchestration.matching` (a target against a checkpoint),
  :mod:`~tierckpt.orchestration.choose` (which copy a restore reads), :mod:`~tierckpt.orchestration.verify`;
* :mod:`~tierckpt.orchestration.coordinator` — the seam through which the ranks of a job agree;
  :mod:`~tierckpt.orchestration.distributed` — its torch.distributed implementation, on the job's store
  (:mod:`~tierckpt.orchestration.storekeys`: what it writes there);
* :mod:`~tierckpt.orchestration.handles` (what ``save`` returns), :mod:`~tierckpt.orchestration.pending`
  (work in flight), :mod:`~tierckpt.orchestration.engines` (shared I/O engines),
  :mod:`~tierckpt.orchestration.process` (the GC pause, the SIGTERM flush),
  :mod:`~tierckpt.orchestration.checks` (argument checks), :mod:`~tierckpt.orchestration.describe`
  (a manifest for humans).

Everything here imports only downward: format, io and policies, then tiers.
"""
