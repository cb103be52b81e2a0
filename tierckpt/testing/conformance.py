"""The conformance suite every tier passes (like zarr's ``StoreTests``).

Bind it in a few lines::

    class TestMyTier(TierConformanceTests):
        @pytest.fixture
        def tier(self, tmp_path):
            t = MyTier("mine", tmp_path)
            yield t
            t.close()

        @pytest.fixture                      # optional: runs the full-tier cases
        def small_tier(self, tmp_path):
            t = MyTier("mine", tmp_path, capacity_bytes=SMALL_CAPACITY_BYTES)
            yield t
            t.close()

The suite uses the :class:`~tierckpt.tiers.base.Tier` contract only (never a tier's attributes, files
or directories), so a tier of any kind (memory, files, an object store) can pass it. It honours the
tier's declared :class:`~tierckpt.tiers.base.TierCapabilities`: buffers, offsets and lengths are
multiples of ``alignment_bytes``; writes are at least ``min_part_bytes`` (except a blob's last) and at
most ``max_part_bytes``; with ``sequential_writes`` each blob is written front to back, one write at a
time, one blob after another.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import pytest
import torch

from tierckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, TierFullError
from tierckpt.format.manifest import BlobEntry
from tierckpt.io.buffers import aligned_empty
from tierckpt.tiers.base import DEVICES, CheckpointKey, Tier, TierCapabilities, TierWriter

__all__ = ["SMALL_CAPACITY_BYTES", "TierConformanceTests"]

#: the capacity a ``small_tier`` fixture gives its tier (committed checkpoints and reservations)
SMALL_CAPACITY_BYTES = 256 << 10
_MANIFEST = b"manifest bytes: opaque to the tier"
# the sizes below are the suite's test data (small blobs, small writes within the tier's declared limits),
# not sizes of the library's I/O: those are the tier's geometry's
_CHUNK = 64 << 10


def _blob(size: int, seed: int) -> torch.Tensor:
    buf = aligned_empty(size)
    g = torch.Generator().manual_seed(seed)
    buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g))
    return buf


def _entries(sizes: list[int]) -> list[BlobEntry]:
    return [BlobEntry(f"blob-{i:05d}.bin", s) for i, s in enumerate(sizes)]


def _align(tier: Tier) -> int:
    """A unit that every tier takes for blob sizes, offsets and lengths."""
    return max(4096, tier.capabilities.alignment_bytes)


def _chunk(caps: TierCapabilities) -> int:
    """The size of the suite's writes: 64 KiB, within the tier's part sizes, a multiple of its alignment."""
    a = caps.alignment_bytes
    c = max(_CHUNK, caps.min_part_bytes)
    if caps.max_part_bytes is not None:
        c = min(c, caps.max_part_bytes)
    return max(a, -(-c // a) * a if c < caps.min_part_bytes else c // a * a)


def _issue(tier: Tier, w: TierWriter, i: int, src: torch.Tensor, stop: int | None = None) -> list[Future[int]]:
    """Write blob ``i`` from ``src`` up to ``stop`` (default: all of it), as the tier's capabilities ask."""
    caps, size = tier.capabilities, src.numel()
    dst = w.buffer(i)
    if dst is not None:  # a memory tier: its own buffer, then writes of it onto itself
        dst.copy_(src)
        src = dst
    chunk, futs = _chunk(caps), []
    for o in range(0, size if stop is None else stop, chunk):
        futs.append(w.write(i, o, src.data_ptr() + o, min(chunk, size - o)))
        if caps.sequential_writes:
            futs[-1].result()  # one at a time, in order
    return futs


def _write(tier: Tier, key: CheckpointKey, blobs: list[torch.Tensor], manifest: bytes = _MANIFEST) -> None:
    w = tier.reserve(key, _entries([b.numel() for b in blobs]))
    try:
        futs = [f for i, b in enumerate(blobs) for f in _issue(tier, w, i, b)]
        for f in futs:
            assert f.result() >= 0
        w.commit(manifest)
    except BaseException:
        w.abort()
        raise


def _read(tier: Tier, key: CheckpointKey, sizes: list[int]) -> list[torch.Tensor]:
    r = tier.reader(key, _entries(sizes))
    try:
        out = []
        for i, s in enumerate(sizes):
            buf = aligned_empty(s)
            assert r.read(i, 0, buf.data_ptr(), s).result() == s
            out.append(buf)
        return out
    finally:
        r.close()


class TierConformanceTests:
    """Subclass this and provide a ``tier`` fixture that yields a fresh, empty tier; optionally a
    ``small_tier`` fixture that yields one whose capacity is :data:`SMALL_CAPACITY_BYTES`."""

    @pytest.fixture
    def tier(self) -> Tier:  # pragma: no cover - overridden
        raise NotImplementedError("bind the suite with a `tier` fixture")

    @pytest.fixture
    def small_tier(self) -> Tier:
        pytest.skip("no `small_tier` fixture (a tier with capacity SMALL_CAPACITY_BYTES): full-tier cases skipped")

    def test_capabilities_declared(self, tier: Tier) -> None:
        caps = tier.capabilities
        assert isinstance(caps, TierCapabilities) and caps.device in DEVICES
        assert isinstance(tier.name, str) and tier.name and isinstance(tier.kind, str)
        assert not getattr(type(tier).from_config, "__isabstractmethod__", False)

    def test_empty(self, tier: Tier) -> None:
        assert tier.list_committed() == []
        assert not tier.holds(CheckpointKey(1))
        with pytest.raises(CheckpointNotFoundError):
            tier.read_manifest(CheckpointKey(1))
        with pytest.raises(CheckpointNotFoundError):
            tier.open_copy(CheckpointKey(1)).read_manifest()

    def test_round_trip(self, tier: Tier) -> None:
        blobs = [_blob(3 * 65536, 1), _blob(4096, 2)]
        _write(tier, CheckpointKey(7), blobs)
        assert tier.list_committed() == [CheckpointKey(7)]
        assert tier.read_manifest(CheckpointKey(7)) == _MANIFEST
        back = _read(tier, CheckpointKey(7), [b.numel() for b in blobs])
        assert all(torch.equal(a, b) for a, b in zip(blobs, back))
        assert tier.used_bytes() >= sum(b.numel() for b in blobs)
        with tier.open_copy(CheckpointKey(7)) as copy:
            assert copy.read_manifest() == _MANIFEST

    def test_partial_read_at_offset(self, tier: Tier) -> None:
        a = _align(tier)
        blob = _blob(8 * a, 3)
        _write(tier, CheckpointKey(1), [blob])
        r = tier.reader(CheckpointKey(1), _entries([blob.numel()]))
        out = aligned_empty(2 * a)
        assert r.read(0, a, out.data_ptr(), 2 * a).result() == 2 * a
        r.close()
        assert torch.equal(out, blob[a : 3 * a])

    def test_short_reads(self, tier: Tier) -> None:
        """A read past a blob's end returns the bytes there are (0 at or past the end), never more."""
        a = _align(tier)
        blob = _blob(3 * a, 31)
        _write(tier, CheckpointKey(1), [blob])
        out = aligned_empty(4 * a)
        r = tier.reader(CheckpointKey(1), _entries([blob.numel()]))
        try:
            assert r.read(0, 2 * a, out.data_ptr(), 4 * a).result() == a
            assert torch.equal(out[:a], blob[2 * a :])
            assert r.read(0, 3 * a, out.data_ptr(), a).result() == 0
            assert r.read(0, 5 * a, out.data_ptr(), a).result() == 0
        finally:
            r.close()

    def test_reader_refuses_a_blob_shorter_than_declared(self, tier: Tier) -> None:
        a = _align(tier)
        _write(tier, CheckpointKey(1), [_blob(2 * a, 32)])
        with pytest.raises(CorruptCheckpointError):
            tier.reader(CheckpointKey(1), _entries([3 * a])).close()

    def test_read_alignment_is_honoured(self, tier: Tier) -> None:
        """Where ``read_alignment`` gives ``(memory, offset)``, reads at exactly that alignment work."""
        blob = _blob(16 * 4096, 8)
        _write(tier, CheckpointKey(1), [blob])
        r = tier.reader(CheckpointKey(1), _entries([blob.numel()]))
        try:
            al = r.read_alignment(0)
            if al is None:
                pytest.skip("this tier reads into staging-aligned buffers only")
            mem, off = al
            assert mem >= 1 and off >= 1 and mem & (mem - 1) == 0 and off & (off - 1) == 0
            base = aligned_empty(8 * 4096 + 8192)
            shift = mem if mem < 4096 else 0  # an address aligned to ``mem`` and to nothing larger
            addr = base.data_ptr() + shift
            start, n = 3 * off, 4096 // off * off * 3 or off
            assert r.read(0, start, addr, n).result() == n
        finally:
            r.close()
        assert torch.equal(base[shift : shift + n], blob[start : start + n])

    def test_uncommitted_is_invisible_and_abort_leaves_nothing(self, tier: Tier) -> None:
        w = tier.reserve(CheckpointKey(3), _entries([4096]))
        assert tier.list_committed() == [] and not tier.holds(CheckpointKey(3))
        w.abort()
        w.abort()  # idempotent
        assert tier.list_committed() == []
        _write(tier, CheckpointKey(4), [_blob(4096, 4)])
        assert tier.list_committed() == [CheckpointKey(4)]

    def test_abort_after_some_writes(self, tier: Tier) -> None:
        """Aborted halfway: nothing listed, the space back, the key reservable again; an aborted
        replacement leaves the committed copy as it was."""
        u = max(_CHUNK, _align(tier))
        old = _blob(4 * u, 40)
        _write(tier, CheckpointKey(1), [old], b"old")
        used = tier.used_bytes()
        for key in (CheckpointKey(2), CheckpointKey(1)):
            w = tier.reserve(key, _entries([4 * u, u]))
            for f in _issue(tier, w, 0, _blob(4 * u, 41), stop=2 * u):
                f.result()
            w.abort()
            w.abort()
            assert tier.list_committed() == [CheckpointKey(1)] and not tier.holds(CheckpointKey(2))
            assert tier.used_bytes() == used
        assert tier.read_manifest(CheckpointKey(1)) == b"old"
        assert torch.equal(_read(tier, CheckpointKey(1), [old.numel()])[0], old)
        new = [_blob(4 * u, 42), _blob(u, 43)]
        _write(tier, CheckpointKey(2), new, b"new")
        assert all(torch.equal(a, b) for a, b in zip(_read(tier, CheckpointKey(2), [4 * u, u]), new))

    def test_cancel_then_abort_leaves_nothing(self, tier: Tier) -> None:
        """``cancel`` (from another thread, writes issued): each write's future resolves, in error or
        not; the abort after them leaves nothing, and the key is written again."""
        u = max(_CHUNK, _align(tier))
        used = tier.used_bytes()
        w = tier.reserve(CheckpointKey(5), _entries([4 * u]))
        futs = _issue(tier, w, 0, _blob(4 * u, 50))
        canceller = threading.Thread(target=w.cancel)
        canceller.start()
        canceller.join()
        w.cancel()  # idempotent
        for f in futs:
            f.exception(timeout=60)
        w.abort()
        assert tier.list_committed() == [] and tier.used_bytes() == used
        new = _blob(4 * u, 51)
        _write(tier, CheckpointKey(5), [new])
        assert torch.equal(_read(tier, CheckpointKey(5), [4 * u])[0], new)

    def test_commit_replaces_same_key(self, tier: Tier) -> None:
        _write(tier, CheckpointKey(2), [_blob(4096, 5)], b"first")
        second = _blob(8192, 6)
        _write(tier, CheckpointKey(2), [second], b"second")
        assert tier.list_committed() == [CheckpointKey(2)]
        assert tier.read_manifest(CheckpointKey(2)) == b"second"
        assert torch.equal(_read(tier, CheckpointKey(2), [8192])[0], second)

    def test_no_blobs(self, tier: Tier) -> None:
        _write(tier, CheckpointKey(9), [], b"only a manifest")
        assert tier.read_manifest(CheckpointKey(9)) == b"only a manifest"

    def test_compressed_copy_round_trip(self, tier: Tier) -> None:
        """A tier that declares ``encoded_copies`` takes a compressed copy (blobs whose writes stop at their
        stored streams: docs/tiers.md, "Compression") and gives it back, through the library's own path."""
        if not tier.capabilities.encoded_copies:
            pytest.skip("the tier does not declare encoded_copies: it is never given a compressed copy")
        from tierckpt.datapath.manifests import load_head
        from tierckpt.hierarchy import Hierarchy
        from tierckpt.policies.compressconfig import CompressConfig

        tier.compress = CompressConfig("zstd")
        g = torch.Generator().manual_seed(5)
        state = {
            "ids": torch.randint(0, 1000, (3 << 18,), dtype=torch.int64, generator=g),
            "w": torch.randn(1 << 20, generator=g).to(torch.bfloat16),
            "noise": torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g),
        }
        h = Hierarchy([tier])
        try:
            h.save(state, step=3, blocking=True)
            frames = load_head(tier, CheckpointKey(3)).frames
            assert frames is not None and 0 < frames.compressed_frames() <= frames.total
            got = h.restore(3)
        finally:
            h.close()
        assert got.keys() == state.keys() and all(torch.equal(got[k], v) for k, v in state.items())

    def test_ranks_and_steps_are_independent(self, tier: Tier) -> None:
        keys = [CheckpointKey(s, r) for s in (5, 10) for r in (0, 1)]
        for i, k in enumerate(keys):
            _write(tier, k, [_blob(4096, 10 + i)], f"m{i}".encode())
        assert tier.list_committed() == sorted(keys)
        tier.evict(CheckpointKey(5, 1))
        assert tier.list_committed() == [CheckpointKey(5, 0), CheckpointKey(10, 0), CheckpointKey(10, 1)]
        assert tier.list_committed(rank=1) == [CheckpointKey(10, 1)]
        assert tier.list_committed(rank=0) == [CheckpointKey(5, 0), CheckpointKey(10, 0)]
        assert tier.holds(CheckpointKey(10, 1)) and not tier.holds(CheckpointKey(5, 1))
        assert tier.read_manifest(CheckpointKey(5, 0)) == b"m0"

    def test_evict(self, tier: Tier) -> None:
        _write(tier, CheckpointKey(1), [_blob(4096, 7)])
        _write(tier, CheckpointKey(2), [_blob(4096, 8)])
        tier.evict(CheckpointKey(1))
        tier.evict(CheckpointKey(1))  # missing: ignored
        assert tier.list_committed() == [CheckpointKey(2)]
        with pytest.raises(CheckpointNotFoundError):
            tier.read_manifest(CheckpointKey(1))

    def test_commit_records(self, tier: Tier) -> None:
        """A step's commit record (docs/distributed.md): written atomically, replaced whole, listed by
        step, removed (a missing one: nothing to do); a step's copies and its record are independent."""
        assert tier.list_records() == [] and tier.read_record(7) is None
        _write(tier, CheckpointKey(7, 0), [_blob(4096, 1)])
        tier.write_record(7, b"first record")
        tier.write_record(3, b"x" * 5000)
        assert tier.list_records() == [3, 7] and tier.read_record(7) == b"first record"
        tier.write_record(7, b"second")
        assert tier.read_record(7) == b"second" and tier.read_record(3) == b"x" * 5000
        tier.remove_record(7)
        tier.remove_record(7)
        tier.remove_record(8)
        assert tier.list_records() == [3] and tier.read_record(7) is None
        assert tier.list_committed() == [CheckpointKey(7, 0)]  # the copy stays: the hierarchy evicts it

    def test_evict_unlisted_now_freed_by_reclaim(self, tier: Tier) -> None:
        _write(tier, CheckpointKey(1), [_blob(65536, 7)])
        _write(tier, CheckpointKey(2), [_blob(4096, 8)])
        used = tier.used_bytes()
        tier.evict(CheckpointKey(1), free=False)
        assert tier.list_committed() == [CheckpointKey(2)] and not tier.holds(CheckpointKey(1))
        with pytest.raises(CheckpointNotFoundError):
            tier.read_manifest(CheckpointKey(1))
        assert tier.used_bytes() <= used
        tier.reclaim()
        tier.reclaim()  # nothing left: a no-op
        assert tier.list_committed() == [CheckpointKey(2)]
        assert tier.used_bytes() < used
        assert torch.equal(_read(tier, CheckpointKey(2), [4096])[0], _blob(4096, 8))

    def test_concurrent_writers_of_different_steps(self, tier: Tier) -> None:
        errors: list[BaseException] = []

        def run(step: int) -> None:
            try:
                _write(tier, CheckpointKey(step), [_blob(65536, step)])
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert tier.list_committed() == [CheckpointKey(s) for s in range(4)]

    # -- a full tier ------------------------------------------------------------------------------------
    def test_full_tier_refuses_and_lists_nothing(self, small_tier: Tier) -> None:
        tier, size = small_tier, _CHUNK
        with pytest.raises(TierFullError):
            tier.reserve(CheckpointKey(99), _entries([SMALL_CAPACITY_BYTES + 4096]))  # never fits
        steps = []
        for step in range(1, 17):
            try:
                _write(tier, CheckpointKey(step), [_blob(size, step)])
            except TierFullError:
                break
            steps.append(step)
        assert 1 <= len(steps) <= SMALL_CAPACITY_BYTES // size, steps  # full, and not before its capacity
        full_at, used = len(steps) + 1, tier.used_bytes()
        assert tier.list_committed() == [CheckpointKey(s) for s in steps] and not tier.holds(CheckpointKey(full_at))
        tier.evict(CheckpointKey(steps[0]))
        _write(tier, CheckpointKey(full_at), [_blob(size, full_at)])  # room is back after an eviction
        assert tier.holds(CheckpointKey(full_at)) and tier.used_bytes() <= used
        assert torch.equal(_read(tier, CheckpointKey(full_at), [size])[0], _blob(size, full_at))

    def test_reservations_count_until_committed_or_aborted(self, small_tier: Tier) -> None:
        tier, a = small_tier, _align(small_tier)
        half = SMALL_CAPACITY_BYTES // 2 // a * a
        first = tier.reserve(CheckpointKey(1), _entries([half]))
        with pytest.raises(TierFullError):  # with the first one's room taken, this one does not fit
            tier.reserve(CheckpointKey(2), _entries([SMALL_CAPACITY_BYTES - half + a]))
        assert tier.list_committed() == []
        for f in _issue(tier, first, 0, _blob(half, 50), stop=a):
            f.result()
        first.abort()
        assert tier.list_committed() == []
        _write(tier, CheckpointKey(2), [_blob(SMALL_CAPACITY_BYTES - half + a, 51)])  # room back after abort
        assert tier.list_committed() == [CheckpointKey(2)]

    # -- readers while a checkpoint is evicted or replaced -------------------------------------------------
    @pytest.mark.parametrize("action", ["replace", "evict"])
    @pytest.mark.parametrize("when", ["opened", "manifest", "reader", "half"])
    def test_reader_meanwhile(self, tier: Tier, action: str, when: str) -> None:
        """Another thread evicts or replaces (twice, so memory may be reused) the copy being read, at
        each point of the read: the copy opened yields entirely the bytes it was opened with, or
        CheckpointNotFoundError; never another version's bytes, never CorruptCheckpointError."""
        size, key = 4 * _align(tier), CheckpointKey(3)
        _write(tier, key, [_version(size, 0)], b"version 0")

        def meanwhile() -> None:
            if action == "evict":
                tier.evict(key)
                _write(tier, CheckpointKey(4), [_version(size, 9)], b"version 9")  # may take the freed memory
            else:  # twice: the second may take the first one's memory
                for v in (1, 2):
                    _write(tier, key, [_version(size, v)], f"version {v}".encode())

        def pause(at: str) -> None:
            if at == when:
                t = threading.Thread(target=meanwhile)
                t.start()
                t.join()

        got = _read_copy(tier, key, size, pause)
        assert got is None or got == 0, f"a copy opened at version 0 read version {got}"
        if action == "evict":
            assert not tier.holds(key) and tier.holds(CheckpointKey(4))
        else:
            assert tier.read_manifest(key) == b"version 2"

    def test_readers_race_evictions_and_replacements(self, tier: Tier) -> None:
        size, key = 4 * _align(tier), CheckpointKey(5)
        _write(tier, key, [_version(size, 0)], b"version 0")
        done = threading.Event()
        errors: list[BaseException] = []
        seen: list[int | None] = []  # the version each read found (None: gone)

        def writer() -> None:  # until 6 versions are written and 4 copies read whole (at most 200 versions)
            try:
                for v in range(1, 200):
                    if v > 6 and sum(x is not None for x in seen) >= 4:
                        break
                    if v % 3 == 0:
                        tier.evict(key)
                    _write(tier, key, [_version(size, v)], f"version {v}".encode())
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)
            finally:
                done.set()

        t = threading.Thread(target=writer)
        t.start()
        try:
            while not done.is_set():
                seen.append(_read_copy(tier, key, size, lambda at: None))  # checks each copy read whole
        finally:
            done.wait()
            t.join()
        assert not errors
        whole = sum(x is not None for x in seen)
        assert whole >= 4, f"{whole} of {len(seen)} reads found a copy while 200 versions were written"


def _version(size: int, v: int) -> torch.Tensor:
    return _blob(size, 1000 + v)


def _read_copy(tier: Tier, key: CheckpointKey, size: int, pause: Callable[[str], None]) -> int | None:
    """Open ``key``'s copy and read it, calling ``pause`` at each point; the version read (its blob
    checked against its manifest), or None where the copy went away (CheckpointNotFoundError)."""
    out = aligned_empty(size)
    half = size // 2 // _align(tier) * _align(tier)
    try:
        with tier.open_copy(key) as copy:
            pause("opened")
            manifest = copy.read_manifest()
            pause("manifest")
            r = copy.reader(_entries([size]))
        try:
            pause("reader")
            n = r.read(0, 0, out.data_ptr(), half).result()
            pause("half")
            n += r.read(0, half, out.data_ptr() + half, size - half).result()
        finally:
            r.close()
    except CheckpointNotFoundError:
        return None
    assert manifest.startswith(b"version "), manifest
    v = int(manifest.split()[1])
    assert n == size and torch.equal(out, _version(size, v)), f"copy of version {v}: its blob holds other bytes"
    return v
