"""Aggregation sized from the file system's facts (tierckpt.io.geometry): the stripes of CephFS, Lustre,
GPFS, GlusterFS and NFS as their clients report them (recorded here), turned into chunks of whole
stripes, pieces of whole stripe units, blobs in whole stripe widths and object sizes, queue depths and
staging within a memory bound; the io overrides of the facts, and their errors."""

from __future__ import annotations

import math

import pytest

from tierckpt.config import IOConfig, LayoutConfig, parse_config
from tierckpt.errors import ConfigError
from tierckpt.format.layout import plan
from tierckpt.io import geometry as geo
from tierckpt.io.geometry import FsFacts, IOGeometry, checkpoint_geometry, io_geometry, stripes_of
from tierckpt.tiers.base import TierCapabilities

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def caps(shared: bool, device: str = "file") -> TierCapabilities:
    return TierCapabilities(persistent=device == "file", shared=shared, device=device, alignment_bytes=4096)


SHARED, LOCAL, MEMORY = caps(True), caps(False), caps(False, "cpu")
IO = IOConfig(engine="threads")

# as the clients report them: statvfs f_bsize, st_blksize, and the layout xattrs
CEPHFS = FsFacts(
    4 * MiB, 4 * MiB, True, family="cephfs", fs_type="fuse.ceph-fuse",
    stripe_unit_bytes=4 * MiB, stripe_count=1, object_bytes=4 * MiB,
)  # fmt: skip  # the default layout
CEPHFS_1M_X4 = FsFacts(
    4 * MiB, MiB, True, family="cephfs", fs_type="ceph", stripe_unit_bytes=MiB, stripe_count=4, object_bytes=4 * MiB
)
LUSTRE_1M_X4 = FsFacts(4096, MiB, True, family="lustre", fs_type="lustre", stripe_unit_bytes=MiB, stripe_count=4)
LUSTRE_4M_X8 = FsFacts(
    4096, 4 * MiB, True, family="lustre", fs_type="lustre", stripe_unit_bytes=4 * MiB, stripe_count=8
)
LUSTRE_4M_X16 = FsFacts(4096, 4 * MiB, True, family="lustre", stripe_unit_bytes=4 * MiB, stripe_count=16)
LUSTRE_1M_X128 = FsFacts(4096, MiB, True, family="lustre", stripe_unit_bytes=MiB, stripe_count=128)
LUSTRE_1M_X6 = FsFacts(4096, MiB, True, family="lustre", stripe_unit_bytes=MiB, stripe_count=6)
GPFS = FsFacts(16 * MiB, 16 * MiB, True, family="gpfs", fs_type="gpfs", stripe_unit_bytes=16 * MiB)
GLUSTER = FsFacts(4096, 4096, True, family="glusterfs", fs_type="fuse.glusterfs")  # distribute: no stripes
NFS_1M = FsFacts(MiB, MiB, True, family="nfs", fs_type="nfs4")  # wsize 1 MiB: f_bsize and st_blksize
EXT4 = FsFacts(4096, 4096, True, family="local", fs_type="ext4")


def pfs(facts: FsFacts, io: IOConfig = IO, **kw: int) -> IOGeometry:
    return io_geometry(SHARED, io, facts, blob_bytes=GiB, one_file=True, whole_blocks=True, **kw)


# facts -> (alignment, stripe unit, stripe width, chunk, piece, blob granule, staging slots, queue depth)
SIZES = {
    "cephfs default 4MiB x1, object 4MiB": (CEPHFS, (4 * MiB, 4 * MiB, 4 * MiB, 32 * MiB, 8 * MiB, 4 * MiB, 6, 16)),
    "cephfs 1MiB x4, object 4MiB": (CEPHFS_1M_X4, (MiB, MiB, 4 * MiB, 32 * MiB, 8 * MiB, 4 * MiB, 6, 16)),
    "lustre 1MiB x4": (LUSTRE_1M_X4, (MiB, MiB, 4 * MiB, 32 * MiB, 8 * MiB, 4 * MiB, 6, 16)),
    "lustre 4MiB x8": (LUSTRE_4M_X8, (4 * MiB, 4 * MiB, 32 * MiB, 32 * MiB, 8 * MiB, 32 * MiB, 6, 16)),
    "lustre 4MiB x16": (LUSTRE_4M_X16, (4 * MiB, 4 * MiB, 64 * MiB, 64 * MiB, 16 * MiB, 64 * MiB, 6, 16)),
    "lustre 1MiB x128": (LUSTRE_1M_X128, (MiB, MiB, 128 * MiB, 32 * MiB, 8 * MiB, MiB, 8, 32)),
    "lustre 1MiB x6": (LUSTRE_1M_X6, (MiB, MiB, 6 * MiB, 30 * MiB, 7 * MiB, 6 * MiB, 6, 16)),
    "gpfs 16MiB blocks": (GPFS, (16 * MiB, 16 * MiB, 16 * MiB, 32 * MiB, 16 * MiB, 16 * MiB, 6, 16)),
    "glusterfs distribute": (GLUSTER, (4 * KiB, 4 * KiB, 4 * KiB, 32 * MiB, 8 * MiB, 4 * KiB, 6, 16)),
    "nfs wsize 1MiB": (NFS_1M, (MiB, MiB, MiB, 32 * MiB, 8 * MiB, MiB, 6, 16)),
    "ext4": (EXT4, (4 * KiB, 4 * KiB, 4 * KiB, 32 * MiB, 8 * MiB, 4 * KiB, 6, 16)),
}


@pytest.mark.parametrize("case", SIZES)
def test_a_pfs_tier_sizes_its_io_from_its_file_systems_stripes(case: str) -> None:
    facts, want = SIZES[case]
    g = pfs(facts)
    got = (
        g.alignment_bytes, g.stripe_unit_bytes, g.stripe_width_bytes, g.chunk_bytes, g.piece_bytes,
        g.blob_align_bytes, g.staging_slots, g.queue_depth,
    )  # fmt: skip
    assert got == want
    # writes start on stripe units and are whole units; a chunk is whole stripes where one fits the bound
    assert g.chunk_bytes % g.stripe_unit_bytes == 0 and g.piece_bytes % g.stripe_unit_bytes == 0
    assert g.chunk_bytes % g.stripe_width_bytes == 0 or g.stripe_width_bytes > geo.MAX_STRIPE_CHUNK
    assert g.stripe_unit_bytes % g.alignment_bytes == 0 and g.chunk_bytes % g.alignment_bytes == 0
    # blobs (so a data file of them) are whole stripes and whole objects, within the pad bound
    assert g.blob_bytes % g.blob_align_bytes == 0 and g.blob_align_bytes <= geo.MAX_BLOB_ALIGN
    if g.stripe_width_bytes <= geo.MAX_BLOB_ALIGN:
        assert g.blob_align_bytes % g.stripe_width_bytes == 0
        assert g.blob_align_bytes % (facts.object_bytes or 1) == 0
    # memory: the staging slots of the tier's worker never hold more than the bound (or the default)
    assert g.staging_slots * g.staging_slot_bytes <= max(geo.MAX_STAGING_BYTES, geo.STAGING_SLOTS * g.chunk_bytes)
    # two writes in flight on every target of a stripe, as far as the staging holds them
    assert g.queue_depth >= min(2 * math.ceil(g.stripe_width_bytes / g.piece_bytes), g.staging_slots * geo.PIECES)
    assert g.steady_reads == geo.READ_SLOTS  # a shared tier keeps every read slot busy


def test_a_64_mib_stripe_doubles_the_staging_and_a_wider_one_is_bounded() -> None:
    assert pfs(LUSTRE_4M_X16).staging_slots * pfs(LUSTRE_4M_X16).staging_slot_bytes == 384 * MiB
    wide = pfs(FsFacts(direct=True, stripe_unit_bytes=4 * MiB, stripe_count=256))  # a 1 GiB stripe
    assert (wide.chunk_bytes, wide.staging_slots) == (32 * MiB, geo.MAX_STAGING_BYTES // (32 * MiB))
    assert wide.queue_depth == wide.staging_slots * geo.PIECES and wide.blob_align_bytes == 4 * MiB
    huge_unit = pfs(FsFacts(direct=True, stripe_unit_bytes=256 * MiB))  # no chunk holds one: not sized for
    assert (huge_unit.alignment_bytes, huge_unit.chunk_bytes, huge_unit.stripe_unit_bytes) == (4096, 32 * MiB, 4096)
    asked = pfs(LUSTRE_1M_X128, chunk_bytes=256 * MiB)  # a chunk asked for covers the stripe: kept
    assert asked.chunk_bytes == 256 * MiB and asked.staging_slots == geo.STAGING_SLOTS


def test_a_local_tier_sizes_for_stripes_the_facts_name_but_not_for_a_bare_block() -> None:
    g = io_geometry(LOCAL, IO, LUSTRE_4M_X8, blob_bytes=256 * MiB)
    assert (g.chunk_bytes, g.blob_align_bytes, g.blob_bytes) == (32 * MiB, 32 * MiB, 256 * MiB)
    assert g.steady_reads == 4  # two 16 MiB reads on each of the stripe's 32 MiB: 4 of the 16 slots
    assert io_geometry(LOCAL, IO, NFS_1M, blob_bytes=MiB).stripe_unit_bytes == 4096  # whole_blocks: pfs only
    assert io_geometry(LOCAL, IO, EXT4, blob_bytes=MiB).steady_reads == geo.STEADY_READS
    assert io_geometry(MEMORY, IOConfig(stripe_unit_bytes=MiB), blob_bytes=GiB).stripe_unit_bytes == 4096


def test_the_io_settings_override_the_detected_stripes() -> None:
    io = IOConfig(engine="threads", stripe_unit_bytes=2 * MiB, stripe_count=3, object_bytes=8 * MiB)
    s = stripes_of(io, LUSTRE_4M_X8)
    assert (s.unit_bytes, s.count, s.object_bytes) == (2 * MiB, 3, 8 * MiB)
    g = pfs(CEPHFS, io)
    assert (g.stripe_unit_bytes, g.stripe_width_bytes, g.chunk_bytes) == (2 * MiB, 6 * MiB, 30 * MiB)
    assert g.blob_align_bytes == 24 * MiB  # lcm(6 MiB stripe, 8 MiB object)
    one = pfs(LUSTRE_4M_X16, IOConfig(stripe_count=1, chunk_bytes=8 * MiB, queue_depth=4))
    assert (one.stripe_width_bytes, one.chunk_bytes, one.queue_depth, one.blob_align_bytes) == (
        4 * MiB, 8 * MiB, 4, 4 * MiB,
    )  # fmt: skip  # every choice reachable: this stripe sized as one target
    odd = stripes_of(IOConfig(stripe_unit_bytes=6 * KiB), EXT4, least=4096)
    assert odd.unit_bytes is None  # not a multiple of the tier's alignment: no unit its writes keep to


def test_a_checkpoint_takes_every_tiers_blob_granule_and_keeps_each_tiers_stripes() -> None:
    host = io_geometry(MEMORY, IO, blob_bytes=GiB, chunk_bytes=32 * MiB)
    ssd = io_geometry(LOCAL, IO, EXT4, blob_bytes=256 * MiB)
    c = checkpoint_geometry(LayoutConfig(), {"host": host, "ssd": ssd, "pfs": pfs(LUSTRE_1M_X6)})
    assert (c.align_bytes, c.blob_align_bytes, c.blob_bytes) == (MiB, 6 * MiB, 1026 * MiB)
    assert c.tiers["pfs"].chunk_bytes == 30 * MiB and c.tiers["ssd"].chunk_bytes == 32 * MiB
    # in a larger alignment a tier's chunk is still whole stripes and its pieces whole units
    g = pfs(LUSTRE_1M_X6).aligned_to(4 * MiB)
    assert g.chunk_bytes % math.lcm(6 * MiB, 4 * MiB) == 0 and g.piece_bytes % (4 * MiB) == 0
    assert g.blob_align_bytes == 12 * MiB and g.blob_bytes % (12 * MiB) == 0
    c = checkpoint_geometry(LayoutConfig(blob_bytes=10 * MiB), {"a": pfs(LUSTRE_1M_X6), "b": pfs(LUSTRE_4M_X16)})
    assert c.blob_align_bytes == 64 * MiB  # lcm(6, 64) MiB is over the bound: the largest alone
    assert c.blob_bytes == 64 * MiB


def test_blobs_are_padded_to_the_granule_and_the_tensors_inside_are_not() -> None:
    lengths = [3000] * 1000 + [5 * MiB, 300 * MiB]
    fine, coarse = (plan(lengths, align=4096, blob_bytes=64 * MiB, blob_align=g) for g in (4096, 32 * MiB))
    assert fine.offsets == coarse.offsets and fine.blobs == coarse.blobs  # extents as with 4 KiB alignment
    assert all(s % (32 * MiB) == 0 for s in coarse.blob_sizes)
    assert all(0 <= c - f < 32 * MiB for f, c in zip(fine.blob_sizes, coarse.blob_sizes))
    with pytest.raises(ValueError, match="blob_align"):
        plan(lengths, align=4096, blob_bytes=GiB, blob_align=6000)


@pytest.mark.parametrize(
    ("io", "message"),
    [
        ({"stripe_unit": "3KiB"}, r"^tiers\[0\]\.io\.stripe_unit: expected a multiple of 4KiB"),
        ({"stripe_unit": "lots"}, r"^tiers\[0\]\.io\.stripe_unit: expected a size"),
        ({"stripe_count": 0}, r"^tiers\[0\]\.io\.stripe_count: expected an integer in \[1, 65535\]"),
        ({"stripe_count": True}, r"^tiers\[0\]\.io\.stripe_count: expected an integer"),
        ({"stripe_unit": "4MiB", "object_size": "6MiB"}, r"^tiers\[0\]\.io\.object_size: expected a multiple of the stripe unit \(4MiB\)"),
        ({"object_size": "5GiB"}, r"^tiers\[0\]\.io\.object_size: expected a multiple of 4KiB up to 4GiB"),
        ({"stripe_size": "4MiB"}, r"^tiers\[0\]\.io\.stripe_size: unknown key \(allowed: .*stripe_unit"),
    ],
)  # fmt: skip
def test_stripe_overrides_are_checked_naming_the_key(io: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"tiers": [{"name": "p", "kind": "pfs", "path": "/x", "io": io}]})


def test_stripe_overrides_merge_into_the_tiers_io() -> None:
    cfg = parse_config(
        {
            "io": {"stripe_count": 8},
            "tiers": [{"name": "p", "kind": "pfs", "path": "/x", "io": {"stripe_unit": "1MiB"}}],
        }
    )
    assert (cfg.tiers[0].io.stripe_unit_bytes, cfg.tiers[0].io.stripe_count, cfg.io.stripe_unit_bytes) == (MiB, 8, None)


def test_ceph_fuse_is_written_buffered_unless_the_tier_asks_for_o_direct() -> None:
    """ceph-fuse's O_DIRECT bypasses its object cache: buffered writes (then fsync) measured ~2x faster,
    so the detected geometry writes buffered there; the kernel client and other file systems keep it."""
    fuse = FsFacts(direct=True, fs_type="fuse.ceph-fuse", family="cephfs", stripe_unit_bytes=4 << 20, stripe_count=1)
    kernel = FsFacts(direct=True, fs_type="ceph", family="cephfs", stripe_unit_bytes=4 << 20, stripe_count=1)
    gluster = FsFacts(direct=True, fs_type="fuse.glusterfs", family="glusterfs")
    blob = 1 << 30
    assert not io_geometry(caps(True), IOConfig(), fuse, blob_bytes=blob).direct
    assert io_geometry(caps(True), IOConfig(), fuse, blob_bytes=blob, direct=True).direct
    assert io_geometry(caps(True), IOConfig(), kernel, blob_bytes=blob).direct
    assert io_geometry(caps(True), IOConfig(), gluster, blob_bytes=blob).direct
