"""NIXL from the outside: listed by ``afd plugins`` from its own distribution, a split model equal to native
over it, the benchmark against raw NIXL, and clear errors for bad settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess
AFD = [sys.executable, "-m", "afd_sdk.cli"]


def _afd(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*AFD, *args], capture_output=True, text=True, timeout=timeout, env=os.environ.copy())


def test_plugins_lists_nixl_from_its_own_distribution():
    res = _afd("plugins", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    (plugin,) = [p for p in data["plugins"] if p["name"] == "nixl"]
    assert plugin["distribution"] == "afd-connector-nixl" and plugin["status"] == "loaded", plugin
    assert plugin["registered"]["connectors"] == ["NixlAFDConnector"]
    (conn,) = [c for c in data["connectors"] if c["name"] == "NixlAFDConnector"]
    assert conn["aliases"] == ["nixl"] and conn["distribution"] == "afd-connector-nixl"


# CI runs 3A2F with two stages; 1A1F (10-15 s) is -m slow: CI's one-pair NIXL worlds are the conformance suite's
# and tests/test_failover.py's (1A1F, two stages, its output bit-equal to the reference after a replica is killed)
@pytest.mark.parametrize(("attention", "ffn", "stages"), [pytest.param(1, 1, 1, marks=pytest.mark.slow), (3, 2, 2)])
def test_demo_over_nixl_equals_native(attention, ffn, stages):
    res = _afd(
        "demo",
        "--connector",
        "nixl",
        "--attention",
        str(attention),
        "--ffn",
        str(ffn),
        "--stages",
        str(stages),
        "--max-new-tokens",
        "4",
        "--json",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["match"] and out["tokens_equal"] and not out["errors"], out
    assert out["connector"] == "nixl"


def test_bench_measures_raw_nixl_and_raw_zmq_in_the_same_run():
    res = _afd("bench", "connector", "--connector", "nixl", "--sizes", "8K,512K", "--iters", "20", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(res.stdout)
    assert data["baselines"] == ["nixl", "zmq"]
    for row in data["rows"]:  # 512K takes the registered-source path, 8K the staging copy
        for key in ("connector", "nixl", "zmq"):
            assert row[key]["median_us"] > 0
        assert row["ratio_nixl"] == pytest.approx(row["connector"]["median_us"] / row["nixl"]["median_us"])
    assert data["ffn_idle_cpu_pct"] is not None


@pytest.mark.parametrize(
    ("extra", "key"), [({"spin_us": -1}, "spin_us"), ({"store_port": "x"}, "store_port"), ({"spinn_us": 5}, "spinn_us")]
)
def test_bad_extra_config_is_one_clear_error(extra, key):
    cfg = json.dumps({"role": "ffn", "connector": "nixl", "connector_extra_config": extra})
    res = _afd("config", "check", cfg)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"afd.connector_extra_config.{key}" in res.stderr


def test_nixl_logs_go_to_stderr_never_into_a_json_result():
    """NIXL's Python package logs INFO lines to standard output; a process that prints ``--json`` there (``afd
    attention generate --json`` over NIXL) would print an unreadable result. Loading NIXL points them at stderr."""
    code = (
        "from afd_connector_nixl.agent import nixl_api\n"
        "import logging\n"
        "nixl_api()\n"
        "logging.getLogger('nixl.api').info('nixl says hello')\n"
        "print('{}')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "{}\n" and "nixl says hello" in res.stderr, (res.stdout, res.stderr)
