"""The sandbox's per-slot uids: the node's own by default, a run's own where it has slots of
its own (the test suite: tests/conftest.py), and a bad setting refused naming the value."""

import pytest

from sandbox.launch import SandboxLimits, node_uid_base

pytestmark = pytest.mark.unit


def test_uid_base_is_the_limits_unless_the_run_has_its_own(monkeypatch):
    limits = SandboxLimits()
    monkeypatch.delenv("PEAGLE_SANDBOX_UID_BASE", raising=False)
    assert node_uid_base(limits) == limits.uid_base
    monkeypatch.setenv("PEAGLE_SANDBOX_UID_BASE", "1600006400")
    assert node_uid_base(limits) == 1_600_006_400


@pytest.mark.parametrize("value", ["abc", "-5", str(2**31 - 1)])
def test_a_bad_uid_base_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv("PEAGLE_SANDBOX_UID_BASE", value)
    with pytest.raises(ValueError, match=repr(value).replace("'", "")):
        node_uid_base(SandboxLimits())
