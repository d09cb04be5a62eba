"""``afd demo``: split a seeded tiny MoE model into real Attention and FFN processes
and check it against the native transformers model."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from afd_sdk.config import parse_config
from afd_sdk.errors import AFDConfigError
from afd_sdk.plugins import get_plugin_manager
from afd_sdk.runtime.world import FAIL_FAST_S, WorldResult, free_port_block, log_tail, run_world
from afd_sdk.topology import AttentionFirstWorld

__all__ = ["DEFAULT_ARCH", "FANIN_TOLERANCE", "run_split", "summarise"]

DEFAULT_ARCH = "Qwen3MoeForCausalLM"
#: tolerance where an FFN rank batches several attention ranks' tokens (MoE kernels are not batch-invariant)
FANIN_TOLERANCE = 1e-5

Event = Callable[[str, dict[str, Any]], None]


def _prompts(rank: int, count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(1, vocab, (count, length), generator=g).tolist()


def run_split(
    *,
    arch: str = DEFAULT_ARCH,
    connector: str = "zmq",
    attention: int = 1,
    ffn: int = 1,
    stages: int = 1,
    max_new_tokens: int = 8,
    prompt_len: int = 6,
    requests_per_rank: int | None = None,
    seed: int = 0,
    timeout_s: float = 60.0,
    on_event: Event | None = None,
) -> dict[str, Any]:
    """Build the tiny model, run the split world and the native reference; return the summary."""
    emit = on_event or (lambda _kind, _data: None)
    pm = get_plugin_manager()
    adapter_cls = pm.adapter_class(arch)
    tiny = adapter_cls.tiny_hf_config(arch)
    if tiny is None:
        raise AFDConfigError(f"--arch {arch} has no tiny transformers config; pick one with a native class", key="arch")
    if max_new_tokens < 1 or prompt_len < 1:
        raise AFDConfigError("--max-new-tokens and the prompt length must be >= 1", key="max_new_tokens")
    port = free_port_block(64)
    afd: dict[str, Any] = {
        "connector": connector,
        "port": port,
        "num_attention_ranks": attention,
        "num_ffn_ranks": ffn,
        "num_stages": stages,
        "timeout_s": timeout_s,
    }
    connector_cls = pm.connector_class(connector)
    afd["connector_extra_config"] = connector_cls.stage_extra_config(stages)
    async_dispatch = connector_cls.capabilities.async_dispatch
    if async_dispatch:  # routed-expert dispatch: the gate runs on Attention
        afd["compute_gate_on_attention"] = True
    for role in ("attention", "ffn"):  # validate both roles before building anything
        pm.resolve_config(parse_config({**afd, "role": role}))
    moe = adapter_cls(arch, tiny).moe_layout()
    if async_dispatch and moe is None:
        raise AFDConfigError(f"--arch {arch} has no routed experts for --connector {connector}", key="arch")
    world = connector_cls.world_for(parse_config({**afd, "role": "attention"}), moe)
    vocab = int((tiny.get("text_config") or tiny)["vocab_size"])
    from afd_sdk.checkpoints import save_tiny_checkpoint

    requests = requests_per_rank or 2 * stages
    with tempfile.TemporaryDirectory(prefix="afd-demo-") as tmp:
        emit("phase", {"phase": f"building a seeded tiny {arch}"})
        model_dir = save_tiny_checkpoint(arch, tmp, seed=seed)
        per_rank = {
            ("attention", r): {"prompts": _prompts(r, requests, prompt_len, vocab, seed)} for r in range(attention)
        }
        spec = {"afd": afd, "model_dir": str(model_dir), "max_new_tokens": max_new_tokens, "reference": True}
        emit("phase", {"phase": f"starting {ffn} FFN + {attention} attention processes over {connector}"})
        t0 = time.perf_counter()
        result = run_world(
            spec,
            per_rank=per_rank,
            module="afd_sdk.runtime.worker",
            timeout_s=timeout_s * 4 + 120,
            on_progress=lambda role, rank, event: emit("progress", {"role": role, "rank": rank, **event}),
            fail_fast_s=FAIL_FAST_S,
        )
        wall = time.perf_counter() - t0
    return summarise(result, world, arch=arch, connector=connector, stages=stages, wall_s=wall)


def summarise(
    result: WorldResult, world: Any, *, arch: str, connector: str, stages: int, wall_s: float
) -> dict[str, Any]:
    failures = [r for r in result.ranks if not r.ok]
    ranks = []
    for r in result.by_role("attention"):
        if isinstance(world, AttentionFirstWorld):  # every FFN rank batches every attention rank's tokens
            ffn_rank, peers = None, world.num_attention
            tol = FANIN_TOLERANCE  # and expert rows are regrouped: MoE kernels are not batch-invariant
        else:
            ffn_rank = world.ffn_for_attention(r.rank)
            peers = len(world.attention_for_ffn(ffn_rank))
            tol = 0.0 if peers == 1 else FANIN_TOLERANCE
        res = r.result
        ok = r.ok and res.get("tokens_equal") is True and res.get("max_abs_diff", float("inf")) <= tol
        ranks.append(
            {
                "rank": r.rank,
                "ffn_rank": ffn_rank,
                "ffn_peers": peers,
                "exact_expected": tol == 0.0,
                "tolerance": tol,
                "max_abs_diff": res.get("max_abs_diff"),
                "max_abs_diff_per_step": res.get("max_abs_diff_per_step", []),
                "tokens_equal": res.get("tokens_equal"),
                "tokens": res.get("tokens"),
                "native_tokens": res.get("native_tokens"),
                "step_ms": [s * 1000 for s in res.get("step_s", [])],
                "exchange_us_median": res.get("exchange_us_median"),
                "match": ok,
            }
        )
    diffs = [x["max_abs_diff"] for x in ranks if x["max_abs_diff"] is not None]
    exch = [x["exchange_us_median"] for x in ranks if x["exchange_us_median"] is not None]
    return {
        "architecture": arch,
        "connector": connector,
        "attention": world.num_attention,
        "ffn": world.num_ffn,
        "stages": stages,
        "max_abs_diff": max(diffs) if diffs else None,
        "tokens_equal": bool(ranks) and all(x["tokens_equal"] is True for x in ranks),
        "match": not failures and bool(ranks) and all(x["match"] for x in ranks),
        "exchange_us_median": statistics.median(exch) if exch else None,
        "wall_s": wall_s,
        "ranks": ranks,
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
