from __future__ import annotations

import subprocess
import sys

import pytest

from tierckpt import ConfigError, available_kinds, get_tier_class, register_tier
from tierckpt.tiers.host import HostTier


def test_builtin_kinds_are_lazy() -> None:
    code = ("import sys, tierckpt; bad = [m for m in ('liburing', 'tierckpt.tiers.local', 'tierckpt.io.uring') "
            "if m in sys.modules]; assert not bad, bad")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)
    assert {"host", "local", "pfs"} <= set(available_kinds())
    assert get_tier_class("host") is HostTier


def test_register_and_conflicts() -> None:
    class MyTier(HostTier):
        kind = "mine"

    register_tier("mine-test", MyTier)
    register_tier("mine-test", MyTier)  # same class again: fine
    assert get_tier_class("mine-test") is MyTier
    with pytest.raises(ValueError, match="already registered"):
        register_tier("mine-test", HostTier)
    register_tier("mine-test", HostTier, clobber=True)
    assert get_tier_class("mine-test") is HostTier
    with pytest.raises(ValueError, match="already registered"):
        register_tier("local", HostTier)


def test_unknown_or_broken_kinds() -> None:
    with pytest.raises(ConfigError, match="unknown tier kind 'tape'"):
        get_tier_class("tape")
    register_tier("broken-test", "no_such_module_xyz:Tier")
    with pytest.raises(ConfigError, match="cannot be imported"):
        get_tier_class("broken-test")


def test_gc_pause_is_reentrant_and_restores_state() -> None:
    import gc

    from tierckpt.background.process import gc_paused as _gc_paused

    assert gc.isenabled()
    with _gc_paused():
        assert not gc.isenabled()
        with _gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with _gc_paused():
            pass
        assert not gc.isenabled()  # a caller that disabled gc keeps it disabled
    finally:
        gc.enable()
