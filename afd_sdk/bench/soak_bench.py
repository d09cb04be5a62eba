"""``afd bench soak``: thousands of steps of the real runtime per connector; memory, fds and threads stay flat?

For each connector, two processes (one Attention, one FFN rank) run a tiny
model through the runtime's own loops (``AttentionRunner.step`` with
``num_stages`` micro-batches, ``FFNServer``) with metrics recording on, as
an operator would run them. After ``warmup`` steps each process samples its
resident memory, open file descriptors and threads; after ``steps`` more it
samples again. A leak of one object, buffer or socket per step shows as
growth proportional to ``steps``. Step times are the attention rank's
wall time per step (every stage, every layer's exchange).

Each step is a forward without KV cache over the same ``[requests, tokens]``
ids, so nothing is expected to grow: what grows is a leak. The bound that
counts as flat is :data:`RSS_BOUND_BYTES` of resident memory and no fd or
thread more.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["RSS_BOUND_BYTES", "main", "process_usage", "run_soak", "settled_usage"]

#: resident-memory growth between the two samples that still counts as flat (allocator noise, lazy imports)
RSS_BOUND_BYTES = 8 << 20
PROGRESS_EVERY = 500
SETTLE_S = 0.3


def process_usage() -> dict[str, int]:
    """This process's resident memory (bytes), open file descriptors and threads, from ``/proc`` (Linux)."""
    text = Path("/proc/self/status").read_text()
    status = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {
        "rss_bytes": int(status["VmRSS"].split()[0]) * 1024,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": int(status["Threads"]),
    }


def settled_usage() -> dict[str, int]:
    """:func:`process_usage` after a collection and a short pause, so exiting threads and garbage are gone."""
    gc.collect()
    time.sleep(SETTLE_S)
    return process_usage()


def _worker(spec: dict[str, Any], out: dict[str, Any]) -> None:
    from afd_sdk.metrics import MetricsHub
    from afd_sdk.runtime.attention_runner import AttentionRunner
    from afd_sdk.runtime.serve import server_for
    from afd_sdk.runtime.session import open_role
    from afd_sdk.runtime.world import report_progress

    torch.set_num_threads(1)
    role, warmup, steps = spec["role"], int(spec["warmup"]), int(spec["steps"])
    session = open_role({**spec["afd"], "role": role}, spec["model_dir"], role_rank=spec["rank"])
    conn = session.connector
    rec = MetricsHub().for_connector(conn)
    conn.init()
    try:
        if role == "ffn":
            server = server_for(conn, session.model, max_steps=warmup, metrics=rec)
            server.serve()
            out["start"] = settled_usage()
            server.max_steps = warmup + steps
            server.serve()
            out["end"] = settled_usage()
            out["steps"] = server.stats.steps - warmup
            return
        runner = AttentionRunner.for_session(session, metrics=rec)
        gen = torch.Generator().manual_seed(0)
        vocab = int(session.model.config.get_text_config().vocab_size)
        ids = torch.randint(1, vocab, (int(spec["requests"]), int(spec["tokens"])), generator=gen)
        for i in range(warmup):
            runner.step(ids, i)
        out["start"] = settled_usage()
        step_s: list[float] = []
        for i in range(steps):
            t0 = time.perf_counter()
            runner.step(ids, warmup + i)
            step_s.append(time.perf_counter() - t0)
            if (i + 1) % PROGRESS_EVERY == 0:
                report_progress(spec, event="step", step=i + 1, of=steps)
        out["end"] = settled_usage()
        out["steps"] = steps
        ms = sorted(s * 1000 for s in step_s)
        out["step_ms"] = {
            "p50": statistics.median(ms),
            "p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
            "mean": statistics.fmean(ms),
        }
        out["exchanges"] = rec.exchanges
    finally:
        conn.close()


def _growth(rank: dict[str, Any]) -> dict[str, Any]:
    start, end = rank["start"], rank["end"]
    d = {k: end[k] - start[k] for k in ("rss_bytes", "fds", "threads")}
    flat = d["rss_bytes"] <= RSS_BOUND_BYTES and d["fds"] <= 0 and d["threads"] <= 0
    return {"start": start, "end": end, "growth": d, "flat": flat}


def run_soak(
    connectors: Sequence[str],
    *,
    steps: int = 10_000,
    warmup: int = 200,
    stages: int = 2,
    requests: int = 2,
    tokens: int = 8,
    arch: str = "Qwen3MoeForCausalLM",
    timeout_s: float = 1800.0,
    on_progress: Callable[[str, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Soak each connector in turn; returns ``{"rows": [...]}`` with usage at start/end and step times."""
    from afd_sdk.checkpoints import save_tiny_checkpoint
    from afd_sdk.errors import AFDConfigError, AFDError
    from afd_sdk.plugins import get_plugin_manager
    from afd_sdk.runtime.world import FAIL_FAST_S, free_port_block, run_world

    pm = get_plugin_manager()
    classes = [pm.connector_class(c) for c in connectors]
    for name, cls in zip(connectors, classes, strict=True):
        if cls.capabilities.async_dispatch:
            raise AFDConfigError(
                f"--connector {name} dispatches routed experts; the soak runs point-to-point connectors "
                "(zmq, p2p, shm, or a third-party AFDConnector)",
                key="connector",
                value=name,
            )
    rows = []
    with tempfile.TemporaryDirectory(prefix="afd-soak-") as tmp:
        model_dir = save_tiny_checkpoint(arch, tmp)
        for name, cls in zip(connectors, classes, strict=True):
            spec = {
                "afd": {
                    "connector": name,
                    "host": "127.0.0.1",
                    "port": free_port_block(16),
                    "timeout_s": 60,
                    "num_stages": stages,
                },
                "model_dir": str(model_dir),
                "steps": steps,
                "warmup": warmup,
                "requests": requests,
                "tokens": tokens,
            }

            def progress(role: str, rank: int, event: dict[str, Any], name: str = name) -> None:
                if on_progress is not None:
                    on_progress(name, event)

            world = run_world(
                spec,
                module="afd_sdk.bench.soak_bench",
                timeout_s=timeout_s,
                on_progress=progress,
                fail_fast_s=FAIL_FAST_S,
            )
            if not all(r.ok for r in world.ranks):
                raise AFDError(f"soak of {name} failed:\n{world.describe()}")
            (attn,) = world.by_role("attention")
            (ffn,) = world.by_role("ffn")
            rows.append(
                {
                    "connector": cls.name,
                    "steps": attn.result["steps"],
                    "ffn_steps": ffn.result["steps"],
                    "exchanges": attn.result["exchanges"],
                    "step_ms": attn.result["step_ms"],
                    "attention": _growth(attn.result),
                    "ffn": _growth(ffn.result),
                }
            )
    return {
        "arch": arch,
        "stages": stages,
        "requests": requests,
        "tokens": tokens,
        "warmup": warmup,
        "rss_bound_bytes": RSS_BOUND_BYTES,
        "rows": rows,
    }


def main(argv: list[str]) -> int:
    from afd_sdk.runtime.world import worker_main

    return worker_main(_worker, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
