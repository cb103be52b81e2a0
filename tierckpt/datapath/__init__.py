"""The data path: a checkpoint's bytes packed, copied between tiers, read back and verified.

* :mod:`~tierckpt.datapath.packing` — tensors packed into a tier's blobs, the manifest built;
* :mod:`~tierckpt.datapath.blobcopy` — a checkpoint's blobs copied from one tier to another;
* :mod:`~tierckpt.datapath.manifests` — a copy's manifest read and checked against the step's commit record;
* :mod:`~tierckpt.datapath.restore` — one copy read into fresh tensors, every byte verified;
  :mod:`~tierckpt.datapath.restore_into` — streamed into existing tensors
  (:mod:`~tierckpt.datapath.matching`: a target paired with a checkpoint);
  :mod:`~tierckpt.datapath.verifier` — the one verifier of the bytes every reader takes;
* :mod:`~tierckpt.datapath.reshard` — DTensor shards filled from the saved ranks' copies
  (:mod:`~tierckpt.datapath.shardread`: the range reads; :mod:`~tierckpt.datapath.replicas`:
  replicated bytes read once per job and broadcast).

Imports only go down: the ranks' seam, then tiers, format, io.
"""
