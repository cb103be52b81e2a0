"""The optional C loops of the data path (``tierckpt.format._native``) and what checks them before use.

On 20,000 tensors of 1-64 KiB the restoring thread spent ~10 us per tensor in the interpreter around a
hash and a copy of ~3 us, and so ran at half the disk's speed (docs/io.md, "Copying bytes"). ``_native.scatter``
runs that loop (gap check, xxh3, copy out) over a table of records in C, without the GIL;
``_native.gather`` is the save side (copy in, zero the gaps, xxh3), and ``_native.hash_into`` hashes
a memory tier's packed blob. ``_native.shuffle`` / ``unshuffle`` split a compressed frame into its byte
planes and join them back (:mod:`tierckpt.format.codec`; numpy does it where the extension is missing).

The checksum stays xxhash's: the extension calls ``XXH3_64bits`` through an address taken from the
python-xxhash extension already loaded (it exports the symbol, with xxhash's CPU dispatch), else from
the system's ``libxxhash.so.0`` (which apt depends on, on Debian and Ubuntu). The function is used only
after it has given the same digests as ``xxhash.xxh3_64_intdigest`` on inputs of every length class of
XXH3. Where the extension was not built, no such function is found, or ``TIERCKPT_NATIVE=0`` is set,
:data:`native` is None and callers use their Python loops (same bytes, same errors).
"""

from __future__ import annotations

import ctypes
import logging
import os
from array import array
from collections.abc import Sequence
from types import ModuleType

import xxhash

from tierckpt.io.buffers import ptr_mv

__all__ = ["THREADS", "Records", "all_zero", "native", "records"]

log = logging.getLogger(__name__)

# XXH3 has separate code paths for 0, 1-3, 4-8, 9-16, 17-128, 129-240 bytes and longer inputs (and
# for whole stripes and blocks): probe one length of each, plus a few long ones.
_PROBE_LENGTHS = (0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1023, 1024, 4097, 70_000, 1 << 20)


def _candidates() -> list[tuple[str, str]]:
    """(library, symbol) pairs that may hold XXH3_64bits, best first."""
    out = []
    ext = getattr(getattr(xxhash, "_xxhash", None), "__file__", None)
    if ext:
        out.append((ext, "XXH3_64bits"))  # python-xxhash's copy, with its CPU dispatch (AVX2 where present)
    out.append(("libxxhash.so.0", "XXH3_64bits"))
    return out


def _load() -> ModuleType | None:
    """The extension with a checked hash function set, or None (see the module docstring)."""
    if os.environ.get("TIERCKPT_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        log.debug("TIERCKPT_NATIVE is off: using the Python loops")
        return None
    try:
        from tierckpt.format import _native
    except ImportError as e:
        log.debug("tierckpt.format._native is not built (%s): using the Python loops", e)
        return None
    probe = bytes((i * 131 + 7) & 0xFF for i in range(max(_PROBE_LENGTHS)))
    for path, symbol in _candidates():
        try:
            addr = ctypes.cast(getattr(ctypes.CDLL(path), symbol), ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
        if addr is None:  # a null symbol: nothing to call
            continue
        if all(_native.digest(probe[:n], addr) == xxhash.xxh3_64_intdigest(probe[:n]) for n in _PROBE_LENGTHS):
            _native.set_hash(addr)
            log.debug("native loops on, %s from %s", symbol, path)
            return _native
        log.warning("%s in %s disagrees with python-xxhash: not used", symbol, path)
    log.debug("no usable XXH3_64bits found: using the Python loops")
    return None


THREADS = max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
"""Threads one ``scatter`` call may use for a run of at least 1 MiB: at most 4, and at most the CPUs
this process may run on (16 MiB of 1-64 KiB tensors, two cores: one thread hashed and copied at
7.5 GB/s, two at 9.3 GB/s; memory bandwidth caps it)."""

native: ModuleType | None = _load()
"""``tierckpt.format._native`` ready to use, or None (then the Python loops run)."""


_ZEROS = bytes(4096)


def all_zero(addr: int, nbytes: int) -> bool:
    """Whether the ``nbytes`` at ``addr`` are all zero (the memory must stay alive during the call)."""
    if native is not None:
        return bool(native.is_zero(addr, nbytes))
    view, z = ptr_mv(addr, nbytes, writable=False), _ZEROS
    return all(view[p : p + len(z)] == z[: min(len(z), nbytes - p)] for p in range(0, nbytes, len(z)))


class Records:
    """The record table the C loops walk: offset, length, checksum and an address for each tensor (its
    destination for ``scatter``, its source for ``gather``), in the order given (the order on disk)."""

    __slots__ = ("table",)

    def __init__(self, table: array[int]) -> None:
        self.table = table

    def set_dst(self, k: int, addr: int) -> None:
        """Set the address (destination or source) of record ``k``."""
        self.table[4 * k + 3] = addr


def records(
    order: Sequence[int],
    offsets: Sequence[int],
    lengths: Sequence[int],
    checksums: Sequence[int],
    dsts: Sequence[int] | None = None,
) -> Records:
    """Records of tensors ``order`` (indices into the columns), with addresses ``dsts[i]`` (or 0)."""
    n = len(order)
    t = array("Q", bytes(32 * n))
    t[0::4] = array("Q", [offsets[i] for i in order])
    t[1::4] = array("Q", [lengths[i] for i in order])
    t[2::4] = array("Q", [checksums[i] for i in order])
    if dsts is not None:
        t[3::4] = array("Q", [dsts[i] for i in order])
    return Records(t)
