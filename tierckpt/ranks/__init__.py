"""How the ranks of a job meet: the coordination seam and the global commit.

* :mod:`~tierckpt.ranks.coordinator` — the :class:`~tierckpt.ranks.coordinator.Coordinator` protocol
  every rank-wide decision goes through, and :class:`~tierckpt.ranks.coordinator.SoloCoordinator`;
* :mod:`~tierckpt.ranks.distributed` — :class:`~tierckpt.ranks.distributed.StoreCoordinator`, on the
  job's torch.distributed store (:mod:`~tierckpt.ranks.storekeys`: what it writes there);
* :mod:`~tierckpt.ranks.commit` — a step's commit record, published once every rank's copy is in.

Imports only go down: format, io, policies, config, then tiers.
"""
