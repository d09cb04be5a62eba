"""ShmAFDConnector specifics: nothing is left in /dev/shm, after close and after a crash of either side."""

import os

import pytest

from afd_sdk.config import parse_config
from afd_sdk.errors import AFDConfigError
from afd_sdk.plugins import get_plugin_manager
from afd_sdk.testing import ConnectorConformance
from afd_sdk.testing.harness import run_world

pytestmark = pytest.mark.multiprocess


def leftovers(port: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"afd-{port}-")]


class _Spec(ConnectorConformance):
    connector = "shm"


@pytest.mark.parametrize("victim", [None, "ffn", "attention"])
def test_no_segments_left_behind(victim):
    spec = _Spec().make_spec("roundtrip", attention=2, stages=2, layers=3, timeout_s=5.0)
    if victim:
        spec["die"] = {"role": victim, "at_layer": 1}
    world = run_world(spec, timeout_s=120)
    if victim is None:
        assert all(r.ok for r in world.ranks), world.describe()
    else:
        survivors = [r for r in world.ranks if r.role != victim]
        assert any(r.error_type == "PeerLostError" for r in survivors), world.describe()
    assert leftovers(spec["afd"]["port"]) == []


def test_rejects_non_loopback_host():
    cfg = parse_config({"role": "ffn", "connector": "shm", "host": "10.1.2.3"})
    with pytest.raises(AFDConfigError, match="same host only"):
        get_plugin_manager().resolve_config(cfg)
