"""Measured split steps: one AFD world per configuration, real processes, the runtime's own runner.

Worker module of :func:`measure_step` (``python -m afd_sdk.plan.sweep SPEC_JSON``): FFN ranks serve until
goodbye; every attention rank times ``repeat`` steps of :class:`~afd_sdk.runtime.attention_runner.AttentionRunner`
on its own requests after ``warmup`` steps, and reports the median. Prefill-shaped steps (``tokens_per_request``
tokens per request, no cache) by default; with a ``context``, decode steps: the runner's ``generate`` over
prompts of ``context`` tokens, its prefill left out, each later step one token per request over the cache.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from afd_sdk.errors import AFDConfigError, AFDError
from afd_sdk.plan.model import Deployment
from afd_sdk.runtime.world import FAIL_FAST_S, free_port_block, run_world, worker_main

__all__ = ["WARMUP_STEPS", "check_decode_contexts", "measure_step", "per_rank_prompts"]

#: steps :func:`measure_step` runs before it times any
WARMUP_STEPS = 3


def check_decode_contexts(contexts: Sequence[int], timed_steps: int, max_positions: int) -> None:
    """Raise :class:`AFDConfigError` unless a decode world over prompts of each of ``contexts`` tokens, decoding
    its prefill's token, :data:`WARMUP_STEPS` and ``timed_steps`` more, fits the bench model's ``max_positions``."""
    past = 1 + WARMUP_STEPS + timed_steps
    longest = max_positions - past
    if contexts and not 1 <= min(contexts) <= max(contexts) <= longest:
        raise AFDConfigError(
            f"context={list(contexts)!r}; expected KV-cache lengths in 1..{longest} (the bench configuration holds "
            f"{max_positions} positions, and a measured decode world runs {past} steps past its prompt)",
            key="context",
            value=list(contexts),
        )


def _worker(spec: dict[str, Any], out: dict[str, Any]) -> None:
    from afd_sdk.runtime.attention_runner import AttentionRunner
    from afd_sdk.runtime.heap import freeze_startup_heap
    from afd_sdk.runtime.serve import server_for
    from afd_sdk.runtime.session import open_role

    torch.set_num_threads(1)
    session = open_role({**spec["afd"], "role": spec["role"]}, spec["model_dir"], role_rank=spec["rank"])
    conn = session.connector
    try:
        conn.init()
        freeze_startup_heap()
        if spec["role"] == "ffn":
            out["serve"] = server_for(conn, session.model).serve().as_dict()
            return
        runner = AttentionRunner.for_session(session)
        if spec.get("context"):
            # step 0 is the prefill of the prompts; the decode steps after it attend over context + step tokens
            result = runner.generate(spec["input_ids"], 1 + spec["warmup"] + spec["repeat"])
            samples = result.step_s[1 + spec["warmup"] :]
        else:
            ids = torch.tensor(spec["input_ids"], dtype=torch.long)
            samples = []
            for step in range(spec["warmup"] + spec["repeat"]):
                t0 = time.perf_counter()
                runner.step(ids, step)
                if step >= spec["warmup"]:
                    samples.append(time.perf_counter() - t0)
        out["step_ms"] = statistics.median(samples) * 1000
        out["samples_ms"] = [s * 1000 for s in samples]
    finally:
        conn.close()


def per_rank_prompts(dep: Deployment, vocab_size: int, length: int, seed: int) -> dict[tuple[str, int], Any]:
    """Each attention rank's ``batch`` seeded random prompts of ``length`` tokens (``run_world``'s ``per_rank``)."""
    g = torch.Generator().manual_seed(seed)
    return {
        ("attention", r): {"input_ids": torch.randint(1, vocab_size, (dep.batch, length), generator=g).tolist()}
        for r in range(dep.attention)
    }


def measure_step(
    dep: Deployment,
    *,
    connector: str,
    model_dir: str,
    vocab_size: int,
    tokens_per_request: int,
    repeat: int = 10,
    warmup: int = WARMUP_STEPS,
    seed: int = 0,
    timeout_s: float = 300.0,
    context: int | None = None,
) -> dict[str, Any]:
    """Run ``dep`` for real; ``step_ms`` is the slowest attention rank's median step (the step every rank waits
    for), ``per_rank_ms`` each rank's median. With ``context``: decode steps over prompts of ``context`` tokens
    (``tokens_per_request`` is then not used; the cache grows by one token per step, ``warmup + repeat`` in all)."""
    from afd_sdk.plugins import get_plugin_manager

    connector_cls = get_plugin_manager().connector_class(connector)
    # routed dispatch (CAM) runs the gate on Attention, as `afd plan` models it
    routed = {"compute_gate_on_attention": True} if connector_cls.capabilities.async_dispatch else {}
    per_rank = per_rank_prompts(dep, vocab_size, context or tokens_per_request, seed)
    spec = {
        "afd": {
            "connector": connector,
            "port": free_port_block(64),
            "num_attention_ranks": dep.attention,
            "num_ffn_ranks": dep.ffn,
            "num_stages": dep.stages,
            "timeout_s": 60,
            "connector_extra_config": connector_cls.stage_extra_config(dep.stages),
            **routed,
        },
        "model_dir": model_dir,
        "repeat": repeat,
        "warmup": warmup,
        "context": context,
    }
    world = run_world(
        spec, per_rank=per_rank, module="afd_sdk.plan.sweep", timeout_s=timeout_s, fail_fast_s=FAIL_FAST_S
    )
    if not all(r.ok for r in world.ranks):
        raise AFDError(f"measuring {dep.label} over {connector} failed:\n{world.describe()}")
    ranks = [r.result["step_ms"] for r in world.by_role("attention")]
    return {"step_ms": max(ranks), "per_rank_ms": ranks}


if __name__ == "__main__":
    sys.exit(worker_main(_worker, sys.argv))
