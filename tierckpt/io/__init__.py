"""I/O engines (io_uring, thread pool) and aligned buffers."""

from tierckpt.io.buffers import StagingPool, aligned_empty, ptr_mv
from tierckpt.io.engine import IOEngine, make_engine

__all__ = ["IOEngine", "StagingPool", "aligned_empty", "make_engine", "ptr_mv"]
