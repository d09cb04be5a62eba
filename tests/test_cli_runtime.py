"""The runtime CLI as operators use it: separate processes, JSON output, clean exits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers", reason="the runtime needs the [hf] extra")

from afd_sdk.integrations.transformers import save_tiny_checkpoint
from afd_sdk.runtime.world import free_port_block

pytestmark = pytest.mark.multiprocess
AFD = [sys.executable, "-m", "afd_sdk.cli"]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return save_tiny_checkpoint("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("qwen"))


def test_ffn_serve_and_attention_generate_as_separate_processes(qwen_dir, tmp_path):
    cfg = tmp_path / "afd.json"
    cfg.write_text(json.dumps({"afd": {"afd_connector": "zmq", "afd_port": free_port_block(16), "timeout_s": 30}}))
    ffn = subprocess.Popen(
        [*AFD, "ffn", "serve", "--model", str(qwen_dir), "--config", str(cfg), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        gen = subprocess.run(
            [
                *AFD,
                "attention",
                "generate",
                "--model",
                str(qwen_dir),
                "--config",
                str(cfg),
                "--prompt-ids",
                "5,6,7,8",
                "--prompt-ids",
                "9,10,11,12",
                "--max-new-tokens",
                "5",
                "--reference",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert gen.returncode == 0, gen.stderr[-3000:]
        out = json.loads(gen.stdout)
        assert out["tokens_equal"] and out["max_abs_diff"] == 0.0
        assert [len(t) for t in out["tokens"]] == [5, 5]
        ffn_out, ffn_err = ffn.communicate(timeout=60)
        assert ffn.returncode == 0, ffn_err[-3000:]
        assert json.loads(ffn_out)["steps"] == 5  # served every step, then left on the goodbye
    finally:
        if ffn.poll() is None:
            ffn.kill()
            ffn.wait(10)


def test_one_ffn_server_serves_independent_worlds(qwen_dir):
    base = free_port_block(32)
    cfg = json.dumps({"afd": {"connector": "zmq", "port": base, "timeout_s": 30}})
    ffn = subprocess.Popen(
        [
            *AFD,
            "ffn",
            "serve",
            "--model",
            str(qwen_dir),
            "--config",
            cfg,
            "--world-port",
            str(base),
            "--world-port",
            str(base + 16),
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for port, n in ((base, 3), (base + 16, 4)):  # one after the other: world 2 steps while world 1 is gone
            world = json.dumps({"afd": {"connector": "zmq", "port": port, "timeout_s": 30}})
            gen = subprocess.run(
                [
                    *AFD,
                    "attention",
                    "generate",
                    "--model",
                    str(qwen_dir),
                    "--config",
                    world,
                    "--prompt-ids",
                    "5,6,7",
                    "--max-new-tokens",
                    str(n),
                    "--reference",
                    "--json",
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert gen.returncode == 0, gen.stderr[-3000:]
            assert json.loads(gen.stdout)["tokens_equal"]
        out, err = ffn.communicate(timeout=60)
        assert ffn.returncode == 0, err[-3000:]
        worlds = json.loads(out)["worlds"]
        assert [(w["port"], w["steps"]) for w in worlds] == [(base, 3), (base + 16, 4)]
        assert err.count("every attention peer said goodbye") == 2
    finally:
        if ffn.poll() is None:
            ffn.kill()
            ffn.wait(10)


def test_world_ports_must_be_distinct(qwen_dir):
    res = subprocess.run(
        [
            *AFD,
            "ffn",
            "serve",
            "--model",
            str(qwen_dir),
            "--config",
            '{"connector": "zmq"}',
            "--world-port",
            "29700",
            "--world-port",
            "29700",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "repeat a port" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_cam_two_ffn_ranks_serve_routed_experts(qwen_dir):
    cfg = json.dumps(
        {
            "afd": {
                "connector": "CAMAsyncAFDConnector",
                "port": free_port_block(16),
                "timeout_s": 30,
                "num_ffn_ranks": 2,
                "compute_gate_on_attention": True,
            }
        }
    )
    ffns = [
        subprocess.Popen(
            [*AFD, "ffn", "serve", "--model", str(qwen_dir), "--config", cfg, "--rank", str(r), "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        gen = subprocess.run(
            [
                *AFD,
                "attention",
                "generate",
                "--model",
                str(qwen_dir),
                "--config",
                cfg,
                "--prompt-ids",
                "5,6,7,8",
                "--max-new-tokens",
                "4",
                "--reference",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert gen.returncode == 0, gen.stderr[-3000:]
        out = json.loads(gen.stdout)
        assert out["tokens_equal"] and out["max_abs_diff"] <= 1e-5
        for ffn in ffns:
            ffn_out, ffn_err = ffn.communicate(timeout=60)
            assert ffn.returncode == 0, ffn_err[-3000:]
            # tiny Qwen3-MoE: layers 1 and 2 are MoE (layer 0 is dense, on Attention): 4 steps x 2 work items
            assert json.loads(ffn_out)["exchanges"] == 8
    finally:
        for ffn in ffns:
            if ffn.poll() is None:
                ffn.kill()
                ffn.wait(10)


def test_role_in_config_must_match_command(qwen_dir):
    res = subprocess.run(
        [*AFD, "ffn", "serve", "--model", str(qwen_dir), "--config", '{"role": "attention"}'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    assert res.stderr.startswith("error: afd.role='attention'") and "Traceback" not in res.stderr


def test_ffn_server_exits_nonzero_when_attention_dies(qwen_dir, tmp_path):
    port = free_port_block(16)
    cfg = json.dumps({"connector": "zmq", "port": port, "timeout_s": 3})
    ffn_log = tmp_path / "ffn.log"
    with open(ffn_log, "w") as log:
        ffn = subprocess.Popen([*AFD, "ffn", "serve", "--model", str(qwen_dir), "--config", cfg], stderr=log, text=True)
    gen = subprocess.Popen(
        [
            *AFD,
            "attention",
            "generate",
            "--model",
            str(qwen_dir),
            "--config",
            cfg,
            "--prompt-ids",
            "1,2,3",
            "--max-new-tokens",
            "4000",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # both loaded and exchanging: the FFN's "connected" line (a fixed sleep once killed the attention side
        # before it had connected on a slow host), then a moment of steps
        deadline = time.monotonic() + 180
        while "attention peers of the world at port" not in ffn_log.read_text():
            assert time.monotonic() < deadline, f"the FFN never connected: {ffn_log.read_text()[-2000:]}"
            assert ffn.poll() is None and gen.poll() is None, ffn_log.read_text()[-2000:]
            time.sleep(0.2)
        time.sleep(2)
        gen.kill()
        gen.wait(10)
        ffn.wait(30)
        err = ffn_log.read_text()
        assert ffn.returncode == 3, err[-2000:]  # a peer lost, not a config error
        assert "error: " in err and ("disconnected" in err or "no " in err), err[-2000:]
    finally:
        for p in (ffn, gen):
            if p.poll() is None:
                p.kill()
                p.wait(10)


def test_demo_json():
    res = subprocess.run(
        [*AFD, "demo", "--json", "--max-new-tokens", "3", "--stages", "2"], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(res.stdout)
    for key in ("architecture", "connector", "attention", "ffn", "stages", "max_abs_diff", "tokens_equal", "match"):
        assert key in data
    assert data["architecture"] == "Qwen3MoeForCausalLM" and data["stages"] == 2
    assert data["match"] is True and data["max_abs_diff"] == 0.0


def test_demo_cam_json():
    # Qwen3.5-MoE's only cross-process CAM run in CI (test_runtime_e2e runs the other architectures)
    res = subprocess.run(
        [
            *AFD,
            "demo",
            "--json",
            "--max-new-tokens",
            "3",
            "--connector",
            "CAMAsyncAFDConnector",
            "--arch",
            "Qwen3_5MoeForConditionalGeneration",
            "--attention",
            "1",
            "--ffn",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(res.stdout)
    assert (data["connector"], data["attention"], data["ffn"]) == ("CAMAsyncAFDConnector", 1, 2)
    assert data["architecture"] == "Qwen3_5MoeForConditionalGeneration"
    assert data["match"] is True and data["max_abs_diff"] <= 1e-5 and data["tokens_equal"] is True
    assert data["ranks"][0]["ffn_rank"] is None  # routed: every FFN rank serves this attention rank


def _workers() -> list[str]:
    out = subprocess.run(["pgrep", "-f", "afd_sdk.runtime.worker"], capture_output=True, text=True).stdout
    return out.split()


#: run a command with SIGINT at its default disposition: a shell without job control (a CI runner, ``cmd &``) starts
#: its children with SIGINT ignored, and Python then installs no KeyboardInterrupt handler, as a terminal's would
_SIGINT_DEFAULT = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])",
]


def test_demo_ctrl_c_leaves_no_process():
    before = set(_workers())
    p = subprocess.Popen(
        [*_SIGINT_DEFAULT, *AFD, "demo", "--max-new-tokens", "250"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(set(_workers()) - before) < 2:
            time.sleep(0.2)
        assert len(set(_workers()) - before) >= 2, "the demo never started its workers"
        os.kill(p.pid, signal.SIGINT)
        code = p.wait(30)
        assert code == 130, f"exit {code}; stderr: {p.stderr.read().decode(errors='replace')[-2000:]}"  # type: ignore[union-attr]
        time.sleep(0.5)
        assert set(_workers()) - before == set()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
