"""The striping a file system gives new files in a directory, as it reports it (read only: nothing here
sets a layout): stripe unit, stripe count, object size, and what else it says about where the bytes go
(a CephFS pool, a Lustre pool, GlusterFS bricks, NFS transfer sizes).

Read from extended attributes and the mount's options:

* CephFS: ``ceph.dir.layout.json`` (Ceph 15 and later: the layout a directory's new files get, its own
  or inherited), ``ceph.dir.layout`` (``stripe_unit=4194304 stripe_count=1 object_size=4194304
  pool=cephfs_data``; only a directory with a layout of its own answers) or its fields
  (``ceph.dir.layout.stripe_unit`` ...); then a file's ``ceph.file.layout`` (the probe file, or an
  existing one); then the nearest parent directory with a layout of its own.
* Lustre: ``lustre.lov``, a binary ``lov_user_md`` (v1 ``0x0BD10BD0``, v3 ``0x0BD30BD0`` with a pool
  name) or a composite one (PFL, ``lov_comp_md_v1`` ``0x0BD60BD0``: its first component on the OSTs),
  on the directory (its default striping) or a file; else ``st_blksize``.
* GPFS: its block size (``statvfs`` ``f_bsize``) as the stripe unit.
* GlusterFS: ``glusterfs.pathinfo`` (the bricks a directory spreads its files over; the shard size of a
  sharded volume is not shown to clients).
* NFS: ``rsize`` and ``wsize`` from the mount's options.

Pure functions over recorded answers (:func:`ceph_striping`, :func:`lustre_striping`, :func:`striping_for`
...) and thin readers (:func:`xattr_getter`, :func:`candidates`). A value that makes no sense (too
long, not a number, out of range, inconsistent) is ignored with a debug log, never raised.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from tierckpt.io.fsdetect import Mount

__all__ = [
    "Candidate",
    "Striping",
    "XattrGet",
    "candidates",
    "ceph_settable",
    "ceph_striping",
    "file_answers",
    "gluster_details",
    "lustre_striping",
    "nfs_details",
    "striping_for",
    "xattr_getter",
]

log = logging.getLogger(__name__)

#: an extended attribute's value by name (None: it has none, or it could not be read)
XattrGet = Callable[[str], "bytes | None"]

_MAX_XATTR = 1 << 20  # a larger value is no layout (the kernel's own limit is 64 KiB)
_MAX_SIZE = (1 << 32) - 1  # stripe units and object sizes are 32-bit fields (CephFS, Lustre)
_MAX_COUNT = 65532  # Lustre's LOV_V1_INSANE_STRIPE_COUNT; CephFS's counts are far below it
_MAX_CEPH_JSON = 4096  # a longer ceph.*.layout.json is no layout
_MAX_PARENTS = 64  # parent directories asked for a CephFS layout before giving up

LOV_MAGIC_V1 = 0x0BD10BD0
LOV_MAGIC_V3 = 0x0BD30BD0
LOV_MAGIC_SPECIFIC = 0x0BD50BD0  # a v3 naming the OSTs to use
LOV_MAGIC_COMP_V1 = 0x0BD60BD0
_LOV_PATTERN_MDT = 0x100  # Data-on-MDT: the component's bytes are on the metadata target, not striped
_LOV_ALL = 0xFFFF  # stripe count -1: every OST; stripe offset -1: any
# field formats without a byte order (read "<" or ">"), and their packed sizes
_LUM = "IIQQIHH"  # lov_user_md_v1: magic pattern oi(id seq) stripe_size count offset
_LUM3_POOL = 16  # lov_user_md_v3: + lmm_pool_name[LOV_MAXPOOLNAME + 1]
_COMP = "IIIHHH6xQ"  # lov_comp_md_v1: magic size gen flags entry_count mirror_count
_ENTRY = "IIQQIIIQI"  # lov_comp_md_entry_v1: id flags start end offset size gen time pad
_LUM_SIZE, _COMP_SIZE, _ENTRY_SIZE = (struct.calcsize("<" + f) for f in (_LUM, _COMP, _ENTRY))  # 32, 32, 48
_EOF = (1 << 64) - 1
_CEPH_FILE = ("json", "", "stripe_unit", "stripe_count", "object_size", "pool")
#: the attributes of a file that say its layout, by family (read while the probe file is open)
_FILE_XATTRS = {
    "cephfs": tuple("ceph.file.layout" + (f".{k}" if k else "") for k in _CEPH_FILE),
    "lustre": ("lustre.lov",),
}


@dataclass(frozen=True)
class Striping:
    """The stripes of new files, as a file system says (see the module's docstring).

    Attributes:
        stripe_unit_bytes: bytes to one stripe target before the next (None: not striped, or not known).
        stripe_count: stripe targets a file's consecutive stripe units go to (None: not known).
        object_bytes: one backing object (CephFS; None: not known).
        source: where the values came from, in words (empty: nowhere).
        details: what else it said, as (name, value) text (pool, pattern, bricks, rsize ...).
    """

    stripe_unit_bytes: int | None = None
    stripe_count: int | None = None
    object_bytes: int | None = None
    source: str = ""
    details: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Candidate:
    """A place to ask for a layout: a directory (its files' layout) or a file (its own)."""

    label: str  #: in words: ``directory /mnt/ckpt``, ``the probe file`` ...
    is_dir: bool
    get: XattrGet


def _number(value: object, hi: int, what: str) -> int | None:
    """``value`` (a decimal text or an int) where it is a whole number in ``[1, hi]``; else None."""
    if isinstance(value, bytes):
        text = value.rstrip(b"\0").strip()
        value = int(text) if text.isdigit() and len(text) <= 20 else None
    elif isinstance(value, bool) or not isinstance(value, int):
        value = None
    if value is None or not 1 <= value <= hi:
        log.debug("ignoring %s: not a number in [1, %d]", what, hi)
        return None
    return value


def _text(value: object, limit: int = 256) -> str:
    """A printable name from ``value`` (bytes or str; a NUL ends it), or ``""``."""
    if isinstance(value, bytes):
        value = value.split(b"\0", 1)[0].decode("utf-8", "replace")
    if not isinstance(value, str) or len(value) > limit or not value.isprintable():
        return ""
    return value


def _ceph_answers(get: XattrGet, prefix: str) -> Iterator[tuple[str, dict[str, object]]]:
    """The raw layout fields under ``prefix`` (``ceph.dir.layout`` or ``ceph.file.layout``), with the
    attribute that gave them, as each form answers: its JSON, its one-line text, its fields one by one."""
    raw = get(prefix + ".json")
    if raw is not None:
        try:  # a layout's JSON is a flat object of a few hundred bytes
            got = json.loads(raw.rstrip(b"\0")) if len(raw) <= _MAX_CEPH_JSON else None
        except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
            got = None
        if isinstance(got, dict):
            yield prefix + ".json", {("pool" if k == "pool_name" else str(k)): v for k, v in got.items()}
        else:
            log.debug("ignoring %s.json: no JSON object", prefix)
    raw = get(prefix)
    if raw is not None:
        words = raw.rstrip(b"\0").split()[:16]
        yield prefix, {k.decode("ascii", "replace"): v for k, _, v in (w.partition(b"=") for w in words)}
    fields = {k: get(f"{prefix}.{k}") for k in ("stripe_unit", "stripe_count", "object_size")}
    if all(v is not None for v in fields.values()):
        yield prefix + ".*", {**fields, "pool": get(prefix + ".pool") or b""}


def ceph_striping(get: XattrGet, is_dir: bool) -> Striping | None:
    """The CephFS layout a directory gives its new files (``is_dir``) or a file has, from its virtual
    extended attributes (the first form that answers with a layout that makes sense: CephFS requires the
    object size to be a multiple of the stripe unit); None where none does."""
    for name, got in _ceph_answers(get, "ceph.dir.layout" if is_dir else "ceph.file.layout"):
        unit = _number(got.get("stripe_unit"), _MAX_SIZE, name + " stripe_unit")
        count = _number(got.get("stripe_count"), _MAX_COUNT, name + " stripe_count")
        size = _number(got.get("object_size"), _MAX_SIZE, name + " object_size")
        if unit is None or count is None or size is None or size % unit:
            log.debug("ignoring %s: no consistent layout in %.200r", name, got)
            continue
        details = [("pool", _text(got.get("pool"))), ("inheritance", _text(got.get("inheritance")))]
        return Striping(unit, count, size, name, tuple((k, v) for k, v in details if v))
    return None


def _on_mdt(pattern: int) -> bool:
    """Whether a ``lmm_pattern`` puts the bytes on the metadata target (Data-on-MDT)."""
    return pattern != 0xFFFFFFFF and pattern & 0xFFFF == _LOV_PATTERN_MDT


def _lum(data: bytes, order: str, what: str) -> Striping | None:
    """A ``lov_user_md`` v1 or v3 (``data`` from its first byte, byte order ``order``)."""
    if len(data) < _LUM_SIZE:
        log.debug("ignoring %s: %d bytes, short of a lov_user_md", what, len(data))
        return None
    magic, pattern, _, _, size, count, offset = struct.unpack_from(order + _LUM, data)
    if magic not in (LOV_MAGIC_V1, LOV_MAGIC_V3, LOV_MAGIC_SPECIFIC):
        log.debug("ignoring %s: magic %#x is no lov_user_md's", what, magic)
        return None
    details = [("pattern", f"{pattern:#x}")]
    if magic in (LOV_MAGIC_V3, LOV_MAGIC_SPECIFIC) and len(data) >= _LUM_SIZE + _LUM3_POOL:
        pool = _text(data[_LUM_SIZE : _LUM_SIZE + _LUM3_POOL])
        details += [("pool", pool)] if pool else []
    details.append(("stripe_offset", "any" if offset == _LOV_ALL else str(offset)))
    if _on_mdt(pattern):
        return Striping(source=what + " (data on the MDT: not striped)", details=tuple(details))
    if size and size % 65536:  # Lustre's stripes are whole multiples of 64 KiB
        log.debug("ignoring %s: stripe size %d is no multiple of 64 KiB", what, size)
        return None
    notes = [] if size else ["stripe size: the file system's default"]
    if count == _LOV_ALL:
        notes.append("stripe count -1: every OST")
    elif not count:
        notes.append("stripe count: the file system's default")
    elif count > _MAX_COUNT:
        log.debug("ignoring %s: stripe count %d", what, count)
        return None
    unit = size or None
    stripes = count if 0 < count <= _MAX_COUNT else None
    return Striping(unit, stripes, None, what + "".join(f"; {n}" for n in notes), tuple(details))


def _composite(data: bytes, order: str, what: str) -> Striping | None:
    """A composite (PFL) layout: its first component striped over OSTs (one on the MDT is passed over)."""
    if len(data) < _COMP_SIZE:
        return None
    _, size, _, _, entries, _, _ = struct.unpack_from(order + _COMP, data)
    if size > len(data) or not 0 < entries <= (size - _COMP_SIZE) // _ENTRY_SIZE:
        log.debug("ignoring %s: a composite layout of %d bytes and %d components in %d", what, size, entries, len(data))
        return None
    skipped = []
    for i in range(entries):
        _, _, start, end, off, length, *_ = struct.unpack_from(order + _ENTRY, data, _COMP_SIZE + i * _ENTRY_SIZE)
        if off < _COMP_SIZE + entries * _ENTRY_SIZE or off + length > size:
            log.debug("ignoring %s: component %d out of bounds", what, i + 1)
            return None
        blob = data[off : off + length]
        if len(blob) >= 8 and _on_mdt(struct.unpack_from(order + "I", blob, 4)[0]):
            skipped.append(f"component {i + 1} (data on the MDT) passed over")
            continue
        part = _lum(blob, order, f"{what}, component {i + 1} of {entries}")
        if part is None:
            return None
        ext = f"[{start}, {'EOF' if end == _EOF else end})"
        note = "; ".join([*skipped, f"the first on the OSTs, extent {ext}; later ones may stripe otherwise"])
        return Striping(part.stripe_unit_bytes, part.stripe_count, None, f"{part.source} (PFL: {note})", part.details)
    return None


def lustre_striping(data: bytes, what: str = "lustre.lov") -> Striping | None:
    """The striping in a ``lustre.lov`` value (``struct lov_user_md``, host byte order; the other order
    is read too), or None where it is none of v1, v3, a v3 of given OSTs or a composite (PFL) one."""
    if not 4 <= len(data) <= _MAX_XATTR:
        return None
    for order in "<>":
        (magic,) = struct.unpack_from(order + "I", data)
        if magic in (LOV_MAGIC_V1, LOV_MAGIC_V3, LOV_MAGIC_SPECIFIC):
            return _lum(data, order, what)
        if magic == LOV_MAGIC_COMP_V1:
            return _composite(data, order, what)
    log.debug("ignoring %s: magic %#x is no layout this reads", what, struct.unpack_from("<I", data)[0])
    return None


def gluster_details(pathinfo: bytes) -> tuple[tuple[str, str], ...]:
    """What a GlusterFS directory's ``glusterfs.pathinfo`` says: its bricks and the translator above
    them (``DISTRIBUTE``, ``REPLICATE``, ``DISPERSE``), e.g. ``<DISTRIBUTE:gv0-dht> <POSIX(/b1):host:/b1/d>
    <POSIX(/b2):host:/b2/d>``."""
    text = pathinfo[:_MAX_XATTR].decode("utf-8", "replace")
    bricks = text.count("<POSIX(")
    if not bricks:
        log.debug("ignoring glusterfs.pathinfo: no brick in %.200r", text)
        return ()
    kinds = [k for k in ("DISTRIBUTE", "REPLICATE", "DISPERSE") if f"<{k}:" in text]
    return (("bricks", str(bricks)), *((("translators", ", ".join(kinds)),) if kinds else ()))


def nfs_details(mount: Mount) -> tuple[tuple[str, str], ...]:
    """An NFS mount's ``rsize`` and ``wsize`` (its largest read and write on the wire) and version."""
    out = []
    for key in ("rsize", "wsize"):
        n = _number((mount.option(key) or "").encode(), 1 << 30, f"the mount option {key}")
        if n is not None:
            out.append((key, str(n)))
    vers = _text(mount.option("vers") or "", 16)
    return (*out, ("vers", vers)) if vers else tuple(out)


def _power_of_two(n: int) -> int | None:
    return n if 4096 <= n <= _MAX_SIZE and not n & (n - 1) else None


def striping_for(
    family: str, asked: Iterable[Candidate], *, block_bytes: int, io_block_bytes: int, mount: Mount | None = None
) -> Striping:
    """The layout of new files in a directory of file-system ``family``, from the first of ``asked``
    that answers (the directory, a file, its parents: :func:`candidates`), its block sizes and its
    mount (empty: none known)."""
    if family == "cephfs":
        for c in asked:
            got = ceph_striping(c.get, c.is_dir)
            if got is not None:
                return Striping(
                    got.stripe_unit_bytes, got.stripe_count, got.object_bytes, f"{got.source} of {c.label}", got.details
                )
        return Striping()
    if family == "lustre":
        for c in asked:
            raw = c.get("lustre.lov")
            got = lustre_striping(raw, f"lustre.lov of {c.label}") if raw is not None else None
            if got is not None:
                return got
        unit = _power_of_two(io_block_bytes)
        return Striping(unit, source="st_blksize (no lustre.lov answered)" if unit else "")
    if family == "gpfs":
        unit = _power_of_two(block_bytes) or _power_of_two(io_block_bytes)
        where = "statvfs f_bsize" if unit == _power_of_two(block_bytes) else "st_blksize"
        return Striping(unit, source=f"{where} (GPFS's block size)" if unit else "")
    if family == "glusterfs":
        for c in asked:
            raw = c.get("glusterfs.pathinfo") or c.get("trusted.glusterfs.pathinfo")
            if raw is not None and c.is_dir:
                return Striping(details=gluster_details(raw), source=f"glusterfs.pathinfo of {c.label}")
        return Striping()
    if family == "nfs" and mount is not None:
        return Striping(details=nfs_details(mount), source="the mount's options")
    return Striping()


# --- readers of this machine -------------------------------------------------------------------------


def xattr_getter(target: str | int) -> XattrGet:
    """A reader of ``target``'s extended attributes (a path, or an open file's descriptor): None for
    one it has not, cannot be read or is longer than 1 MiB."""

    def get(name: str) -> bytes | None:
        try:
            value = os.getxattr(target, name)
        except OSError as e:
            log.debug("getxattr(%s, %s): %s", target, name, e.strerror)
            return None
        return value if len(value) <= _MAX_XATTR else None

    return get


def file_answers(family: str, fd: int) -> dict[str, bytes]:
    """The layout attributes of the open file ``fd`` that a file system of ``family`` answers (a
    snapshot: the probe file is gone before the layout is decided)."""
    get = xattr_getter(fd)
    got = {name: get(name) for name in _FILE_XATTRS.get(family, ())}
    return {k: v for k, v in got.items() if v is not None}


def ceph_settable(fd: int) -> bool | None:
    """Whether this client may set a new file's CephFS layout (its MDS capability may lack the ``p``
    flag): the empty file ``fd``'s (the probe file's) stripe count set to what it is already. None where
    it shows none."""
    count = xattr_getter(fd)("ceph.file.layout.stripe_count")
    if count is None or _number(count, _MAX_COUNT, "ceph.file.layout.stripe_count") is None:
        return None
    try:
        os.setxattr(fd, "ceph.file.layout.stripe_count", count.rstrip(b"\0").strip())
    except OSError as e:
        log.debug("cannot set the probe file's layout: %s", e.strerror)
        return False
    return True


def candidates(directory: str, file: Candidate | None, mount_point: str, family: str) -> Iterator[Candidate]:
    """Where to ask for the layout of new files in ``directory``, in order: the directory; ``file``
    (the probe file's answers, or an existing file's); on CephFS, where a directory without a layout of
    its own may not answer (``ceph.dir.layout`` before Ceph 15, the kernel client), its parents up to
    ``mount_point``."""
    yield Candidate(f"directory {directory}", True, xattr_getter(directory))
    if file is not None:
        yield file
    if family != "cephfs" or not mount_point:
        return
    path = directory
    for _ in range(_MAX_PARENTS):
        if path == mount_point or os.path.dirname(path) == path:
            return
        path = os.path.dirname(path)
        yield Candidate(f"parent {path}", True, xattr_getter(path))
