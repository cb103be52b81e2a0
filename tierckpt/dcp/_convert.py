"""DCP's format utilities over a hierarchy: ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` and
``torch_save_to_dcp`` build DCP's own file-system reader and writer; these take a hierarchy instead
(docs/distributed.md, "DCP backend", "Format utilities")."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from tierckpt.dcp._reader import HierarchyReader
from tierckpt.dcp._writer import HierarchyWriter

if TYPE_CHECKING:
    from tierckpt.hierarchy import Hierarchy

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp"]


def dcp_to_torch_save(h: Hierarchy, torch_save_path: str | os.PathLike[str], *, step: int | None = None) -> None:
    """Write step ``step`` (None: the newest) of ``h``, saved through DCP by any number of ranks, as one
    ``torch.save`` file of full tensors: what DCP's ``dcp_to_torch_save`` makes of its own checkpoints.

    It loads the whole state into this process's memory (DCP's caveat: run it on one process; in a job,
    ``h`` must reach every saving rank's part, e.g. through a shared tier).

    Raises:
        CheckpointNotFoundError: no such step.
        TierckptError: the step was not saved through DCP.
    """
    sd: dict[str, Any] = {}
    _load_state_dict(
        sd, storage_reader=HierarchyReader(h, step=step), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    torch.save(sd, torch_save_path)


def torch_save_to_dcp(torch_save_path: str | os.PathLike[str], h: Hierarchy, *, step: int) -> None:
    """Save the state in a ``torch.save`` file as step ``step`` of ``h`` through DCP, by this process alone
    (``h`` of one rank, or every rank of ``h`` converting its own file): DCP's ``torch_save_to_dcp``.

    The file is read with ``weights_only=False`` as DCP's does: only convert files you trust.
    """
    state_dict = torch.load(torch_save_path, weights_only=False)
    dcp.save(state_dict, storage_writer=HierarchyWriter(h, step), no_dist=True)
