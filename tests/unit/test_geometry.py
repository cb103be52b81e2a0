"""One I/O geometry (tierckpt.io.geometry): a pure function from a tier's capabilities, its file system's
facts (recorded here) and its io settings to every size its I/O uses; a hierarchy's checkpoint geometry
from its layout settings and its tiers'. And what the tiers make of it: facts probed without writing,
the geometry every sizing site reads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tierckpt.config import IOConfig, LayoutConfig
from tierckpt.io.fsutil import probe_fs
from tierckpt.io.geometry import (
    DIRECT_READ_MIN,
    PAGE,
    READ_SLOT_BYTES,
    READ_SLOTS,
    STAGING_SLOTS,
    STEADY_READS,
    FsFacts,
    IOGeometry,
    checkpoint_geometry,
    io_geometry,
)
from tierckpt.tiers.base import EngineSource, TierCapabilities
from tierckpt.tiers.host import HostTier

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
FILE = TierCapabilities(persistent=True, shared=False, device="file", alignment_bytes=4096)
SHARED = TierCapabilities(persistent=True, shared=True, device="file", alignment_bytes=4096)
MEMORY = TierCapabilities(persistent=False, shared=False, device="cpu", alignment_bytes=4096)
S3 = TierCapabilities(
    persistent=True, shared=True, device="object", alignment_bytes=1, min_part_bytes=5 * MiB, max_part_bytes=5 * GiB
)
# facts as recorded on file systems (statvfs f_bsize, st_blksize, statx DIO alignment)
EXT4_NVME = FsFacts(block_bytes=4096, io_block_bytes=4096, direct=True, dio_mem_align=4, dio_offset_align=512)
LUSTRE = FsFacts(block_bytes=4096, io_block_bytes=4 * MiB, direct=True)  # st_blksize: the stripe size
GPFS = FsFacts(block_bytes=16 * MiB, io_block_bytes=16 * MiB, direct=True)
NFS_ODD = FsFacts(block_bytes=1_048_000, io_block_bytes=1_048_000, direct=False)  # not a power of two
HUGE = FsFacts(block_bytes=64 * MiB, io_block_bytes=64 * MiB, direct=True)  # larger than any block
IO = IOConfig(engine="threads")


def test_a_local_tier_on_ext4_keeps_the_sizes_it_had() -> None:
    g = io_geometry(FILE, IO, EXT4_NVME, blob_bytes=256 * MiB)
    assert g == IOGeometry(
        alignment_bytes=4096, direct=True, blob_bytes=256 * MiB, one_file=False, chunk_bytes=32 * MiB,
        piece_bytes=8 * MiB, queue_depth=16, staging_slots=STAGING_SLOTS, staging_slot_bytes=32 * MiB,
        read_slots=READ_SLOTS, read_slot_bytes=READ_SLOT_BYTES, memory_alignment_bytes=4096,
        steady_reads=STEADY_READS, direct_read_min_bytes=DIRECT_READ_MIN,
    )  # fmt: skip
    assert io_geometry(FILE, IO, LUSTRE, blob_bytes=256 * MiB).alignment_bytes == 4096  # only pfs takes blocks


@pytest.mark.parametrize(
    ("facts", "align"),
    [(EXT4_NVME, 4096), (LUSTRE, 4 * MiB), (GPFS, 16 * MiB), (NFS_ODD, 4096), (HUGE, 4096), (FsFacts(), 4096)],
)
def test_a_pfs_tier_aligns_to_the_file_systems_block(facts: FsFacts, align: int) -> None:
    g = io_geometry(SHARED, IO, facts, blob_bytes=GiB, one_file=True, whole_blocks=True)
    assert g.alignment_bytes == align and g.one_file
    for size in (g.blob_bytes, g.chunk_bytes, g.piece_bytes, g.staging_slot_bytes, g.read_slot_bytes):
        assert size % align == 0 and size >= align


def test_the_tiers_own_settings_win_over_the_hierarchys_and_direct_needs_the_file_system() -> None:
    g = io_geometry(FILE, IO, EXT4_NVME, blob_bytes=MiB, chunk_bytes=8 * MiB, direct=False)
    assert (g.chunk_bytes, g.staging_slot_bytes, g.piece_bytes, g.direct) == (8 * MiB, 8 * MiB, 2 * MiB, False)
    assert not io_geometry(FILE, IO, FsFacts(direct=False), blob_bytes=MiB).direct
    assert not io_geometry(FILE, IOConfig(direct=False), EXT4_NVME, blob_bytes=MiB).direct
    assert io_geometry(FILE, IOConfig(queue_depth=64, chunk_bytes=12 * KiB), blob_bytes=MiB).queue_depth == 64
    assert io_geometry(FILE, IOConfig(chunk_bytes=12 * KiB), blob_bytes=MiB).piece_bytes == 4 * KiB


def test_a_memory_tier_stages_through_the_hierarchys_chunk() -> None:
    g = io_geometry(MEMORY, IOConfig(chunk_bytes=4 * MiB), blob_bytes=GiB, chunk_bytes=32 * MiB)
    assert (g.chunk_bytes, g.staging_slot_bytes, g.piece_bytes, g.direct) == (32 * MiB, 4 * MiB, MiB, False)


def test_an_object_tiers_parts_bound_its_chunk_and_its_pieces() -> None:
    g = io_geometry(S3, IO, blob_bytes=GiB, chunk_bytes=8 * MiB)
    assert (g.alignment_bytes, g.chunk_bytes, g.piece_bytes) == (1, 8 * MiB, 8 * MiB)  # a quarter is < 5 MiB
    assert io_geometry(S3, IO, blob_bytes=GiB, chunk_bytes=MiB).chunk_bytes == 5 * MiB
    assert io_geometry(S3, IO, blob_bytes=GiB, chunk_bytes=64 * MiB).piece_bytes == 16 * MiB


def test_a_checkpoint_takes_the_largest_alignment_and_blob_size_and_every_tier_follows() -> None:
    local = io_geometry(FILE, IOConfig(chunk_bytes=100 * KiB), EXT4_NVME, blob_bytes=256 * MiB)
    pfs = io_geometry(SHARED, IO, LUSTRE, blob_bytes=GiB + 1, one_file=True, whole_blocks=True)
    host = io_geometry(MEMORY, IOConfig(chunk_bytes=12 * KiB), blob_bytes=GiB, chunk_bytes=32 * MiB)
    c = checkpoint_geometry(LayoutConfig(), {"host": host, "ssd": local, "pfs": pfs})
    assert c.align_bytes == 4 * MiB and c.blob_bytes == GiB + 4 * MiB and c.read_slot_bytes == 16 * MiB
    for g in c.tiers.values():
        assert g.alignment_bytes == 4 * MiB
        assert not (g.chunk_bytes | g.piece_bytes | g.staging_slot_bytes | g.blob_bytes) % (4 * MiB)
    assert c.tiers["ssd"].chunk_bytes == c.tiers["ssd"].staging_slot_bytes == 4 * MiB
    assert c.tiers["host"].staging_slot_bytes == 4 * MiB and c.tiers["pfs"] == pfs
    c = checkpoint_geometry(LayoutConfig(align_bytes=64 * KiB, blob_bytes=MiB + 1), {"ssd": local})
    assert (c.align_bytes, c.blob_bytes, c.tiers["ssd"].chunk_bytes) == (64 * KiB, MiB + 64 * KiB, 64 * KiB)
    with pytest.raises(ValueError, match="not a power of two of at least"):
        pfs.aligned_to(4096)


def test_the_reads_of_a_copy_and_their_buffers_follow_the_tier_and_the_copys_alignment() -> None:
    g = io_geometry(FILE, IOConfig(chunk_bytes=1 * MiB + 12 * KiB), EXT4_NVME, blob_bytes=MiB)
    assert (g.read_chunk(4096), g.first_read(4096)) == (MiB + 12 * KiB, 256 * KiB)  # a quarter, aligned
    assert (g.read_chunk(64 * KiB), g.first_read(64 * KiB)) == (MiB, 256 * KiB)  # a copy written in 64 KiB
    assert (g.read_chunk(4 * MiB), g.first_read(4 * MiB)) == (4 * MiB, 4 * MiB)  # never below the alignment
    assert g.read_staging_bytes == READ_SLOTS * READ_SLOT_BYTES
    assert g.buffer_alignment(512) == PAGE and g.buffer_alignment(MiB) == MiB


def test_the_memory_alignment_is_o_directs_for_a_file_tier_and_the_capabilities_for_another() -> None:
    assert io_geometry(FILE, IO, EXT4_NVME, blob_bytes=MiB).memory_alignment_bytes == PAGE  # statx's 4: a page
    big = FsFacts(direct=True, dio_mem_align=16 * KiB, dio_offset_align=512)
    assert io_geometry(FILE, IO, big, blob_bytes=MiB).memory_alignment_bytes == 16 * KiB
    assert io_geometry(S3, IO, blob_bytes=GiB).memory_alignment_bytes == 1
    assert io_geometry(MEMORY, IO, blob_bytes=GiB).memory_alignment_bytes == 4096


def test_a_shared_tier_keeps_every_read_slot_busy_after_the_match() -> None:
    assert io_geometry(FILE, IO, EXT4_NVME, blob_bytes=MiB).steady_reads == STEADY_READS
    assert io_geometry(SHARED, IO, LUSTRE, blob_bytes=MiB, whole_blocks=True).steady_reads == READ_SLOTS


def test_restore_into_stages_a_copy_in_its_own_alignment() -> None:
    local = io_geometry(FILE, IO, EXT4_NVME, blob_bytes=256 * MiB)
    c = checkpoint_geometry(LayoutConfig(), {"ssd": local})
    assert c.read_staging(4096) == (READ_SLOT_BYTES, PAGE)
    assert c.read_staging(64 * MiB) == (64 * MiB, 64 * MiB)  # a copy written with a larger alignment
    odd = io_geometry(FILE, IO, FsFacts(direct=True, dio_mem_align=16 * KiB), blob_bytes=MiB)
    assert checkpoint_geometry(LayoutConfig(), {"odd": odd}).read_staging(4096) == (READ_SLOT_BYTES, 16 * KiB)


def test_facts_are_probed_without_writing_where_the_tier_only_reads(tmp_path: Path) -> None:
    before = os.stat(tmp_path).st_mtime_ns
    facts = probe_fs(tmp_path, writable=False)
    assert not facts.direct and not facts.readonly and facts.block_bytes > 0  # nothing to try O_DIRECT on
    (tmp_path / "manifest").write_bytes(b"x" * 4096)
    before = os.stat(tmp_path).st_mtime_ns
    sampled = probe_fs(tmp_path, writable=False, sample=tmp_path / "manifest")
    assert os.stat(tmp_path).st_mtime_ns == before
    written = probe_fs(tmp_path, writable=True)  # creates and removes a probe file
    assert sampled == written
    os.mkfifo(tmp_path / "fifo")
    assert not probe_fs(tmp_path, writable=False, sample=tmp_path / "fifo").direct  # and did not block


def test_a_tier_without_a_geometry_of_its_own_gets_one_from_its_capabilities() -> None:
    t = HostTier("host", 64 * MiB)
    assert t.geometry.chunk_bytes == t.chunk_bytes and t.geometry.blob_bytes == t.preferred_blob_bytes
    assert t.geometry.staging_slot_bytes == IOConfig().chunk_bytes  # until it joins a hierarchy
    t.use_io(EngineSource(), IOConfig(chunk_bytes=4 * MiB))  # a memory tier takes no engine from it
    assert t.geometry.staging_slot_bytes == 4 * MiB
