"""A rank's node identity (environment, overrides, validation), the ``{rank}`` / ``{node}`` placeholders
of tier paths, the ``distributed:`` config section, and the job identity the ranks share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tierckpt.config import TierConfig, parse_config
from tierckpt.configvalues import expand_placeholders, node_identity
from tierckpt.errors import ConfigError
from tierckpt.ranks.coordinator import SoloCoordinator
from tierckpt.ranks.distributed import default_coordinator, min_step, shared_job
from tierckpt.tiers.options import local_directory

_VARS = (
    "TIERCKPT_NODE", "GROUP_RANK", "SLURM_NODEID", "LOCAL_RANK", "SLURM_LOCALID", "LOCAL_WORLD_SIZE", "RANK",
    "TIERCKPT_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID",
)  # fmt: skip


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in _VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize(
    ("env", "rank", "node", "want"),
    [
        ({}, 5, None, (0, 5)),  # nothing known: one node
        ({"LOCAL_WORLD_SIZE": "4"}, 6, None, (1, 2)),
        ({"GROUP_RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 7, None, (3, 1)),  # torchrun
        ({"SLURM_NODEID": "2", "SLURM_LOCALID": "0"}, 8, None, (2, 0)),
        ({"TIERCKPT_NODE": "9", "GROUP_RANK": "3", "LOCAL_RANK": "1"}, 7, None, (9, 1)),  # the override
        ({"TIERCKPT_NODE": "9", "GROUP_RANK": "3"}, 7, 4, (4, 7)),  # the argument beats the environment
    ],
)
def test_node_identity_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], rank: int, node: int | None, want: tuple[int, int]
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert node_identity(rank, node) == want


@pytest.mark.parametrize(
    ("var", "value"), [("TIERCKPT_NODE", "two"), ("GROUP_RANK", "-1"), ("LOCAL_WORLD_SIZE", "0"), ("LOCAL_RANK", "1.5")]
)
def test_a_bad_node_variable_is_a_config_error_naming_it(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=rf"\${var}: expected an integer"):
        node_identity(0)


def test_the_solo_coordinator_knows_its_node() -> None:
    c = SoloCoordinator(rank=3, world_size=4, node=2)
    assert (c.node, c.local_rank, c.ranks_on_node()) == (2, 3, [3])
    assert c.gather("k", 5, lambda vs: vs) == [5]
    with pytest.raises(ConfigError, match="node: expected a node index"):
        SoloCoordinator(node=True)  # type: ignore[arg-type]
    assert isinstance(default_coordinator(1, 2), SoloCoordinator)  # no process group: every rank alone


@pytest.mark.parametrize(
    ("path", "want"),
    [
        ("/ckpt/{rank}", "/ckpt/3"),
        ("/ckpt/node{node}/rank-{rank:05d}", "/ckpt/node1/rank-00003"),
        ("/ckpt/{{literal}}/{rank}", "/ckpt/{literal}/3"),
        ("${SCRATCH}/{node}", "${SCRATCH}/1"),  # left for the environment's expansion
        ("/ckpt/plain", "/ckpt/plain"),
    ],
)
def test_placeholders_are_filled(path: str, want: str) -> None:
    assert expand_placeholders(path, "tiers[1].path", rank=3, node=1) == want


@pytest.mark.parametrize(
    ("path", "error"),
    [
        ("/ckpt/{host}", r"tiers\[1\].path: unknown placeholder \{host\}"),
        ("/ckpt/{}", r"unknown placeholder \{\}"),
        ("/ckpt/{rank.real}", r"unknown placeholder \{rank.real\}"),
        ("/ckpt/{rank", r"a lone '\{'"),
        ("/ckpt/rank}", r"a lone '\}'"),
        ("/ckpt/{rank:q}", r"bad format \{rank:q\}"),
    ],
)
def test_bad_placeholders_are_config_errors_naming_the_key(path: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        parse_config({"tiers": [{"name": "host", "kind": "host"}, {"name": "ssd", "kind": "local", "path": path}]})


def test_a_tier_config_fills_its_own_rank_and_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = TierConfig(name="ssd", kind="local", location="n{node}/r{rank}", base_dir=tmp_path, rank=5, node=2)
    assert local_directory(cfg) == tmp_path / "n2" / "r5"
    monkeypatch.setenv("RANK", "7")  # no rank given: the process's own
    monkeypatch.setenv("TIERCKPT_NODE", "4")
    assert local_directory(TierConfig(name="ssd", kind="local", location="n{node}/r{rank}", base_dir=tmp_path)) == (
        tmp_path / "n4" / "r7"
    )


def test_the_distributed_section() -> None:
    tiers = [{"name": "host", "kind": "host"}]
    cfg = parse_config({"tiers": tiers, "distributed": {"timeout": 30, "node": 2}})
    assert (cfg.distributed.timeout, cfg.distributed.node) == (30.0, 2)
    assert parse_config({"tiers": tiers}).distributed.timeout is None
    for bad, error in (
        ({"timeout": 0}, "distributed.timeout: expected a number of seconds"),
        ({"timeout": True}, "distributed.timeout"),
        ({"node": -1}, "distributed.node: expected a node index"),
        ({"nodes": 1}, "distributed.nodes: unknown key"),
    ):
        with pytest.raises(ConfigError, match=error):
            parse_config({"tiers": tiers, "distributed": bad})


class _Gathers(SoloCoordinator):
    """Rank ``rank`` of a job whose ranks resolved ``values`` (``[explicit identity or None, identity]``)."""

    connects_ranks = True  # it stands for a coordinator the ranks agree through

    def __init__(self, rank: int, values: list[list[Any]]) -> None:
        super().__init__(rank=rank, world_size=len(values))
        self.values = values

    def all_gather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        return [obj if r == self.rank else v for r, v in enumerate(self.values)]


def test_the_ranks_share_one_job_identity() -> None:
    assert shared_job(SoloCoordinator(0, 2), None) is None  # ranks that share nothing: their own
    assert shared_job(_Gathers(0, [[], [None, "process-b"]]), None) is None  # rank 0's own
    assert shared_job(_Gathers(1, [[None, "process-a"], []]), None) == "process-a"  # nobody named one: rank 0's
    assert shared_job(_Gathers(0, [[], ["slurm-7", "slurm-7"]]), None) == "slurm-7"  # one rank's environment
    assert shared_job(_Gathers(1, [["x", "x"], []]), "x") == "x"
    with pytest.raises(ConfigError, match="rank 0 'x', rank 1 'y'"):
        shared_job(_Gathers(1, [["x", "x"], []]), "y")


def test_min_step() -> None:
    assert min_step([3, 1, 2]) == 1 and min_step([3, None]) is None
    with pytest.raises(TypeError, match="rank 1 sent True"):
        min_step([3, True])  # type: ignore[list-item]


# -- a process a launcher started as one of several, before init_process_group -------------------------------
_PAIRS = [
    ("WORLD_SIZE", "RANK"),
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
    ("PMI_SIZE", "PMI_RANK"),
    ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"),
    ("JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK"),
    ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID"),
]
_LAUNCH = (*(v for pair in _PAIRS for v in pair), "SLURM_NTASKS")


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for v in _LAUNCH:
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


@pytest.mark.parametrize(("var", "rank_var"), _PAIRS)
def test_one_of_several_launched_ranks_without_a_process_group_is_refused(
    tmp_path: Path, no_launcher: pytest.MonkeyPatch, var: str, rank_var: str
) -> None:
    from tierckpt import Hierarchy, SoloCoordinator
    from tierckpt.tiers.host import HostTier

    no_launcher.setenv(var, "2")
    cfg = {"tiers": [{"name": "host", "kind": "host"}, {"name": "pfs", "kind": "pfs", "path": str(tmp_path / "pfs")}]}
    want = rf"\${var} is 2: this process is one of the 2 ranks of a job, but torch.distributed is not initialized"
    with pytest.raises(ConfigError, match=want) as e:
        Hierarchy.from_config(cfg)
    assert "init_process_group" in str(e.value) and "coordinator=" in str(e.value)
    assert not (tmp_path / "pfs").exists()  # refused before any directory is made
    with pytest.raises(ConfigError, match=want):
        Hierarchy([HostTier("host")])
    # the ways out: a process that saves alone says so; a reader needs no coordinator, only its rank
    Hierarchy([HostTier("host")], world_size=1).close()
    Hierarchy.from_config(cfg, coordinator=SoloCoordinator()).close()
    with pytest.raises(ConfigError, match=rf"but \${rank_var} is not set or not an integer, so a read-only hierarchy"):
        Hierarchy.from_config(cfg, readonly=True)
    no_launcher.setenv(rank_var, "1")
    with Hierarchy.from_config(cfg, readonly=True) as h:
        assert (h.rank, h.world_size, h.checkpoints()) == (1, 2, [])
    with Hierarchy([HostTier("host")], readonly=True) as h:
        assert (h.rank, h.world_size, h.coordinator.connects_ranks) == (1, 2, False)
    no_launcher.setenv(rank_var, "2")
    with pytest.raises(ConfigError, match=rf"\${rank_var} is 2, not in \[0, 2\)"):
        Hierarchy.from_config(cfg, readonly=True)


def test_any_launcher_that_says_several_processes_means_several(no_launcher: pytest.MonkeyPatch) -> None:
    from tierckpt import Hierarchy
    from tierckpt.tiers.host import HostTier

    no_launcher.setenv("SLURM_NTASKS", "4")  # a batch script of a 4-task job: one process
    no_launcher.setenv("WORLD_SIZE", "1")
    Hierarchy([HostTier("host")]).close()
    no_launcher.setenv("SLURM_STEP_NUM_TASKS", "2")  # WORLD_SIZE=1 left over in an srun step of 2 tasks
    with pytest.raises(ConfigError, match=r"\$SLURM_STEP_NUM_TASKS is 2: this process is one of the 2 ranks"):
        Hierarchy([HostTier("host")])
    no_launcher.setenv("SLURM_PROCID", "1")
    with Hierarchy([HostTier("host")], readonly=True) as h:
        assert (h.rank, h.world_size) == (1, 2)
    no_launcher.setenv("WORLD_SIZE", "4")  # torchrun inside srun: torchrun's (the inner launcher's) says the job
    no_launcher.setenv("RANK", "3")
    with Hierarchy([HostTier("host")], readonly=True) as h:
        assert (h.rank, h.world_size) == (3, 4)


def test_a_malformed_launcher_variable_is_ignored_with_a_warning(
    no_launcher: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tierckpt import Hierarchy
    from tierckpt.tiers.host import HostTier

    no_launcher.setenv("WORLD_SIZE", "abc")
    no_launcher.setenv("RANK", "x")
    # a single process: it builds, as it did before the launcher checks
    with caplog.at_level("WARNING", logger="tierckpt.coordination"), Hierarchy([HostTier("host")]) as h:
        assert (h.rank, h.world_size) == (0, 1)
    assert "$WORLD_SIZE is 'abc', not an integer of at least 1: ignored" in caplog.text
    no_launcher.setenv("PMI_SIZE", "3")  # another launcher says several: refused all the same
    with pytest.raises(ConfigError, match=r"\$PMI_SIZE is 3: this process is one of the 3 ranks"):
        Hierarchy([HostTier("host")])
