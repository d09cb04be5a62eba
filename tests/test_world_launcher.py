"""``run_world``: every process reaped, failures reported, and fail-fast for demos and benchmarks."""

import threading
import time
from pathlib import Path

import pytest

from afd_sdk.runtime import world
from afd_sdk.runtime.world import free_port_block, run_world
from afd_sdk.testing import init_in_threads

pytestmark = pytest.mark.multiprocess

_WORKER = """
import sys, time
from afd_sdk.runtime.world import worker_main

def run(spec, out):
    if spec["role"] == "ffn":
        raise RuntimeError("model checkpoint missing")
    time.sleep(spec["sleep_s"])  # a peer that would wait for the FFN until its own timeout

sys.exit(worker_main(run, sys.argv))
"""


def _world(tmp_path: Path, **kw):
    (tmp_path / "failing_world.py").write_text(_WORKER)
    spec = {"afd": {"num_attention_ranks": 2}, "sleep_s": 60}
    t0 = time.monotonic()
    world = run_world(spec, module="failing_world", env={"PYTHONPATH": str(tmp_path)}, **kw)
    return world, time.monotonic() - t0


def test_fail_fast_stops_the_other_ranks_soon_after_one_fails(tmp_path):
    world, wall = _world(tmp_path, timeout_s=60, fail_fast_s=1.0)
    assert wall < 20, wall  # not the world's 60 s timeout
    (ffn,) = world.by_role("ffn")
    assert ffn.returncode == 1 and ffn.error_type == "RuntimeError" and not ffn.killed
    assert ffn.result["error_message"] == "model checkpoint missing"
    for attn in world.by_role("attention"):
        assert attn.returncode is None and attn.killed == "another rank failed"
    assert "(killed: another rank failed)" in world.describe()


def test_without_fail_fast_survivors_run_until_the_timeout(tmp_path):
    # long enough for a cold interpreter to import torch on a loaded 2-core host and reach run()
    world, wall = _world(tmp_path, timeout_s=10)
    assert wall >= 10
    for attn in world.by_role("attention"):
        assert attn.returncode is None and attn.killed == "still running after 10s"
        # where it was when the launcher gave up: its stack, printed on the launcher's signal before the kill
        assert "Current thread" in attn.stderr and "in run" in attn.stderr, attn.stderr
    assert "line 8 in run" in world.describe()  # the worker's time.sleep line


class _Side:
    def __init__(self, error: Exception | None = None, block: threading.Event | None = None) -> None:
        self.error, self.block, self.done = error, block, False

    def init(self) -> None:
        if self.block is not None:
            self.block.wait(5)
        if self.error is not None:
            raise self.error
        self.done = True


def test_init_in_threads_runs_both_roles_and_reports_each_failure():
    ffn, peers = _Side(), [_Side(), _Side()]
    init_in_threads(ffn, peers)
    assert ffn.done and all(p.done for p in peers)
    with pytest.raises(ValueError, match="peer 1 refused"):
        init_in_threads(_Side(), [_Side(), _Side(ValueError("peer 1 refused"))])
    release = threading.Event()
    try:
        with pytest.raises(TimeoutError, match="init-attention0 did not finish init"):
            init_in_threads(_Side(), [_Side(block=release)], timeout_s=0.2)
    finally:
        release.set()


def test_port_blocks_avoid_the_ephemeral_range(monkeypatch):
    """Outgoing connections of worlds running in parallel take ephemeral ports; a block there can be stolen."""
    low, high = world._ephemeral_ports()
    for _ in range(50):
        base = free_port_block(64)
        assert base + 63 < low or base > high, (base, low, high)
    monkeypatch.setattr(world, "_ephemeral_ports", lambda: (1024, 65535))  # no room outside: anywhere will do
    base = free_port_block(8)
    assert world._PORT_FLOOR <= base <= 65536 - 8
