"""``afd demo --engine vllm``: a seeded tiny checkpoint split across real vLLM processes, checked against native vLLM.

One FFN process per FFN rank serves the layers from vLLM's own modules
(:mod:`~afd_sdk.integrations.vllm.ffn`); one ``vllm.LLM`` engine per attention
rank runs the ``AFD<arch>`` alias. Each attention rank submits prompts of
different lengths and output lengths at once, and the engine is configured
small (few sequences, a small token budget per step) so the scheduler
batches continuously: requests join and finish at different steps, long
prompts are prefilled in chunks beside other requests' decodes. A native
vLLM engine (no AFD) runs the same prompt sets, concurrently, as the
reference: greedy tokens must be equal and every sampled token's logprob
within :data:`LOGPROB_TOLERANCE`.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from afd_sdk.config import parse_config
from afd_sdk.errors import AFDConfigError
from afd_sdk.plugins import get_plugin_manager
from afd_sdk.runtime.world import FAIL_FAST_S, RankResult, free_port_block, log_tail, run_world

__all__ = ["ENGINE", "LOGPROB_TOLERANCE", "WORLD_ENV", "compare_generations", "prompt_set", "run_split_vllm"]

#: the issue's bound for fp32; one FFN rank batching several engines' tokens regroups expert rows
LOGPROB_TOLERANCE = 1e-4
#: small on purpose: 3 running sequences, 16 tokens per step -> chunked prefill mixed with decodes
ENGINE: dict[str, Any] = {"max_model_len": 64, "max_num_seqs": 3, "max_num_batched_tokens": 16, "seed": 0}
#: every process of the world: in-process engine core (starts in ~2 s), 1 GiB KV cache, one OpenMP thread
#: each (the machine's cores are shared by all of them), loopback only
WORLD_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_NO_USAGE_STATS": "1",
}

Event = Callable[[str, dict[str, Any]], None]


def prompt_set(rank: int, vocab: int, seed: int, max_new_tokens: int) -> dict[str, list[Any]]:
    """Four prompts of different lengths with different output lengths for attention rank ``rank``."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    lengths = (5, 23, 3, 12)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]
    budget = [max_new_tokens, max(1, max_new_tokens // 2), max_new_tokens + 3, max(1, max_new_tokens - 2)]
    return {"prompts": prompts, "max_tokens": budget}


def compare_generations(split: dict[str, Any], native: dict[str, Any]) -> dict[str, Any]:
    """Tokens equal, and the largest |logprob diff| over the positions both runs sampled."""
    diffs = [
        abs(a - b)
        for xs, ys in zip(split["logprobs"], native["logprobs"], strict=True)
        for a, b in zip(xs, ys, strict=False)
    ]  # strict=False: a diverging request stops at the shorter one
    return {"tokens_equal": split["tokens"] == native["tokens"], "max_abs_diff": max(diffs) if diffs else 0.0}


def run_split_vllm(
    *,
    arch: str = "Qwen3MoeForCausalLM",
    connector: str = "zmq",
    attention: int = 1,
    ffn: int = 1,
    max_new_tokens: int = 8,
    seed: int = 0,
    timeout_s: float = 60.0,
    multiprocess: bool = False,
    engine: dict[str, Any] | None = None,
    on_event: Event | None = None,
) -> dict[str, Any]:
    """Build the tiny checkpoint, run native and split vLLM worlds concurrently, and compare.

    ``multiprocess`` runs each engine as vLLM does by default: engine core and
    worker in their own processes (the AFD alias and its connector then live in
    the worker process, which reaches afd-sdk only through the entry point).
    ``engine`` overrides :data:`ENGINE` for every engine, native included
    (e.g. a KV cache too small for the batch, to force preemption).
    """

    def emit(kind: str, data: dict[str, Any]) -> None:
        if on_event is not None:
            on_event(kind, data)

    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise AFDConfigError(
            f"--engine vllm needs vLLM in this environment ({exc}); create it with ./scripts/bootstrap-vllm.sh and "
            "run .venv-vllm/bin/afd demo --engine vllm",
            key="engine",
            value="vllm",
        ) from None
    pm = get_plugin_manager()
    adapter_cls = pm.adapter_class(arch)
    tiny = adapter_cls.tiny_hf_config(arch)
    if tiny is None:
        raise AFDConfigError(f"--arch {arch} has no tiny config to build a checkpoint from", key="arch", value=arch)
    binding = adapter_cls(arch, tiny).binding("vllm")
    afd: dict[str, Any] = {
        "connector": connector,
        "port": free_port_block(64),
        "num_attention_ranks": attention,
        "num_ffn_ranks": ffn,
        "timeout_s": timeout_s,
    }
    connector_cls = pm.connector_class(connector)
    if connector_cls.capabilities.async_dispatch:  # routed-expert dispatch: the gate runs on Attention
        afd["compute_gate_on_attention"] = True
        if binding.build_local_experts is None:
            raise AFDConfigError(
                f"--connector {connector} dispatches routed experts (gate on Attention); {arch}'s vLLM binding "
                "offers no routed-expert split; use zmq, shm or p2p, or --engine reference",
                key="connector",
                value=connector,
            )
    for role in ("attention", "ffn"):  # validate both roles before building anything
        pm.resolve_config(parse_config({**afd, "role": role}))
    vocab = int((tiny.get("text_config") or tiny)["vocab_size"])
    from afd_sdk.checkpoints import save_tiny_checkpoint

    sets = [prompt_set(r, vocab, seed, max_new_tokens) for r in range(attention)]
    with tempfile.TemporaryDirectory(prefix="afd-vllm-demo-") as tmp:
        emit("phase", {"phase": f"building a seeded tiny {arch} (vLLM CPU kernel sizes)"})
        model_dir = save_tiny_checkpoint(arch, tmp, seed=seed, overrides=binding.tiny_overrides)
        spec = {
            "afd": afd,
            "model_dir": str(model_dir),
            "engine": {**ENGINE, **(engine or {})},
            "dtype": binding.cpu_dtype,
        }
        per_rank: dict[tuple[str, int], dict[str, Any]] = {("attention", r): sets[r] for r in range(attention)}
        per_rank[("native", 0)] = {"prompt_sets": sets}
        emit(
            "phase",
            {"phase": f"starting {ffn} FFN + {attention} vLLM attention engines over {connector}, and native vLLM"},
        )
        t0 = time.perf_counter()
        result = run_world(
            spec,
            per_rank=per_rank,
            module="afd_sdk.integrations.vllm.worker",
            timeout_s=timeout_s * 4 + 180,
            env={**WORLD_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0"},
            roles=("ffn", "attention", "native"),
            on_progress=lambda role, rank, event: emit("progress", {"role": role, "rank": rank, **event}),
            fail_fast_s=FAIL_FAST_S,
        )
        wall = time.perf_counter() - t0
    summary = summarise(result.ranks, arch=arch, connector=connector, attention=attention, ffn=ffn, wall_s=wall)
    summary["multiprocess"] = multiprocess
    summary["dtype"] = binding.cpu_dtype
    return summary


def summarise(
    ranks: list[RankResult], *, arch: str, connector: str, attention: int, ffn: int, wall_s: float
) -> dict[str, Any]:
    """The demo's summary: same keys as the reference runtime's (``match``, ``tokens_equal``, ``max_abs_diff``)."""
    failures = [r for r in ranks if not r.ok]
    native = next((r for r in ranks if r.role == "native" and r.ok), None)
    rows = []
    for r in (x for x in ranks if x.role == "attention"):
        res = r.result
        row: dict[str, Any] = {
            "rank": r.rank,
            "tokens": res.get("tokens"),
            "goodbye_sent": res.get("goodbye_sent"),
            "generate_s": res.get("generate_s"),
            "tokens_equal": None,
            "max_abs_diff": None,
            "cut": res.get("cut"),
        }
        if r.ok and native is not None:
            ref = native.result["sets"][r.rank]
            row.update(compare_generations(r.result, ref), native_tokens=ref["tokens"])
        row["match"] = row["tokens_equal"] is True and (row["max_abs_diff"] or 0.0) <= LOGPROB_TOLERANCE
        rows.append(row)
    diffs = [x["max_abs_diff"] for x in rows if x["max_abs_diff"] is not None]
    served = [{**r.result["serve"], "cut": r.result.get("cut")} for r in ranks if r.role == "ffn" and r.ok]
    return {
        "engine": "vllm",
        "architecture": arch,
        "connector": connector,
        "attention": attention,
        "ffn": ffn,
        "stages": 1,
        "tolerance": LOGPROB_TOLERANCE,
        "max_abs_diff": max(diffs) if diffs else None,
        "tokens_equal": bool(rows) and all(x["tokens_equal"] is True for x in rows),
        "match": not failures and bool(rows) and len(rows) == attention and all(x["match"] for x in rows),
        "wall_s": wall_s,
        "ranks": rows,
        "ffn_serve": served,
        "errors": [
            {
                "role": r.role,
                "rank": r.rank,
                "returncode": r.returncode,
                "error_type": r.result.get("error_type"),
                "error": r.result.get("error_message") or log_tail(r.stderr, 500),
            }
            for r in failures
        ],
    }
