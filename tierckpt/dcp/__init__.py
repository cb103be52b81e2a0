"""tierckpt as a storage backend of torch.distributed.checkpoint (DCP).

DCP plans (which rank writes which tensor chunk, deduplication, resharding on load); tierckpt stores:
each rank's items of a step go into one :meth:`Hierarchy.save` of that rank (packed into a few blobs,
checksummed, demoted and evicted as the hierarchy's policy says), and DCP's metadata goes, encoded as
plain data (no pickle), into the part of DCP's coordinator (rank 0 unless ``coordinator_rank`` says)::

    from tierckpt.dcp import HierarchyReader, HierarchyWriter
    dcp.save(sd, storage_writer=HierarchyWriter(h, step=n))
    dcp.async_save(sd, storage_writer=HierarchyWriter(h, step=n))
    dcp.load(sd, storage_reader=HierarchyReader(h, step=n))  # step=None: the newest
    stager = HierarchyStager()  # staging buffers kept across dcp.async_save calls
    dcp.async_save(sd, storage_writer=HierarchyWriter(h, step=n), async_stager=stager)
    dcp_to_torch_save(h, "model.pt", step=n)  # one torch.save file of full tensors

docs/distributed.md, "DCP backend", says what each rank writes, when ``dcp.save`` returns, and the limits.
"""

from __future__ import annotations

from tierckpt.dcp._convert import dcp_to_torch_save, torch_save_to_dcp
from tierckpt.dcp._layout import RESERVED
from tierckpt.dcp._reader import HierarchyReader
from tierckpt.dcp._record import Location
from tierckpt.dcp._stager import HierarchyStager
from tierckpt.dcp._writer import DURABLE, HierarchyWriter, StepExistsError

__all__ = [
    "DURABLE",
    "RESERVED",
    "HierarchyReader",
    "HierarchyStager",
    "HierarchyWriter",
    "Location",
    "StepExistsError",
    "dcp_to_torch_save",
    "torch_save_to_dcp",
]
