"""Split models reproduce native transformers output: real processes on loopback.

Exactness: where an FFN rank serves a single attention rank, the FFN sees
exactly the token tensor the native model's FFN sees, so logits must be
bit-identical. Where an FFN rank batches several attention ranks (fan-in), the
MoE kernels see a different row count and are not batch-invariant, so logits
must agree within 1e-5 and greedy tokens must be identical.

CI runs a representative matrix; ``pytest -m slow`` runs the full one
(7 architectures x 3 connectors x 3 topologies x 2 stage counts, and for
CAMAsyncAFDConnector 7 architectures x 4 topologies x 2 stage counts). With
CAM every FFN rank batches routed rows of every attention rank, so the 1e-5
bound applies throughout.
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("transformers", reason="the runtime E2E needs the [hf] extra")

from afd_sdk.runtime.demo import run_split

pytestmark = pytest.mark.multiprocess

ARCHS = [
    "Qwen3MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "GlmMoeDsaForCausalLM",
    "DeepseekV4ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3NextForCausalLM",
]
CONNECTORS = ["zmq", "p2p", "shm"]
TOPOLOGIES = [(1, 1), (2, 1), (3, 2)]
STAGES = [1, 2]

FULL = list(itertools.product(ARCHS, CONNECTORS, TOPOLOGIES, STAGES))
# CI: every architecture across processes at least once (here or in the CAM matrix below; the adapter kit runs
# each architecture's split in-process on every run); every connector sees fan-in (3A2F) and two stages, and the
# 1A1F bit-exact path (shm's fan-in: the conformance suite's TestShm); DeepSeek-V4's token-id extra crosses p2p and shm
REPRESENTATIVE = sorted(
    {
        ("Qwen3MoeForCausalLM", "zmq", (3, 2), 1),
        ("DeepseekV2ForCausalLM", "zmq", (1, 1), 2),
        ("Qwen3MoeForCausalLM", "p2p", (3, 2), 2),
        ("Qwen3NextForCausalLM", "p2p", (2, 1), 2),
        ("DeepseekV4ForCausalLM", "p2p", (1, 1), 2),
        ("DeepseekV4ForCausalLM", "shm", (2, 1), 1),
    }
)


def _check(arch: str, connector: str, topo: tuple[int, int], stages: int) -> None:
    a, f = topo
    s = run_split(
        arch=arch, connector=connector, attention=a, ffn=f, stages=stages, max_new_tokens=4, prompt_len=5, timeout_s=60
    )
    assert not s["errors"], s["errors"]
    assert len(s["ranks"]) == a
    for r in s["ranks"]:
        assert r["tokens_equal"], r
        assert len(r["max_abs_diff_per_step"]) == 4
        if r["exact_expected"]:
            assert r["max_abs_diff"] == 0.0, f"rank {r['rank']} should be bit-exact: {r['max_abs_diff']}"
        else:
            assert r["max_abs_diff"] <= 1e-5, r
    assert s["match"]


@pytest.mark.parametrize(("arch", "connector", "topo", "stages"), REPRESENTATIVE, ids=str)
def test_split_matches_native(arch, connector, topo, stages):
    _check(arch, connector, topo, stages)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "connector", "topo", "stages"), [c for c in FULL if c not in REPRESENTATIVE], ids=str)
def test_split_matches_native_full_matrix(arch, connector, topo, stages):
    _check(arch, connector, topo, stages)


# --- CAMAsyncAFDConnector: gate + shared experts on Attention, routed experts spread over F FFN ranks ---------

CAM_ARCHS = [a for a in ARCHS if a != "DeepseekV4ForCausalLM"] + ["DeepseekV32ForCausalLM"]  # V4: gate on FFN only
CAM_TOPOLOGIES = [(1, 2), (2, 2), (3, 2), (2, 3)]  # A < F, and 2A3F places 4 experts as 2+1+1
CAM_FULL = list(itertools.product(CAM_ARCHS, CAM_TOPOLOGIES, STAGES))
# CI: each architecture once but GLM-MoE-DSA (the adapter kit splits it in-process on every run; Qwen3.5-MoE
# through `afd demo --connector CAMAsyncAFDConnector` in test_cli_runtime),
# every topology at least once, the cheap 1A2F for most
CAM_REPRESENTATIVE = sorted(
    {
        ("Qwen3MoeForCausalLM", (2, 2), 2),
        ("DeepseekV3ForCausalLM", (3, 2), 1),
        ("DeepseekV2ForCausalLM", (2, 3), 1),
        ("Qwen3NextForCausalLM", (1, 2), 2),
        ("DeepseekV32ForCausalLM", (1, 2), 1),
    }
)


@pytest.mark.parametrize(("arch", "topo", "stages"), CAM_REPRESENTATIVE, ids=str)
def test_cam_split_matches_native(arch, topo, stages):
    _check(arch, "CAMAsyncAFDConnector", topo, stages)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "topo", "stages"), [c for c in CAM_FULL if c not in CAM_REPRESENTATIVE], ids=str)
def test_cam_split_matches_native_full_matrix(arch, topo, stages):
    _check(arch, "CAMAsyncAFDConnector", topo, stages)
