"""One rank of an async-dispatch (CAM-style) protocol check: ``python -m afd_sdk.testing.dispatch_worker SPEC``.

No model: expert ``e`` is the elementwise map ``x * (e + 1) + e``, which gives
the same bits for a row whatever batch it is computed in, so the Attention
side can check the connector's dispatch + combine against a local computation
*exactly*. Routing ``plan``s: ``random`` (seeded top-k), ``skewed`` (every
token to experts 0..k-1, so other FFN ranks get empty items), ``empty`` (zero
tokens). The FFN side serves work items until the connector reports that every
attention rank left, and reports each item's size. Between steps an attention
rank may idle (``pause_s``) or freeze itself (``freeze_s``: ``SIGSTOP``, with a
``kill -CONT`` scheduled that long after). An FFN rank may die holding its
item number ``die_after_items`` (counted from 0), or freeze for ``freeze_s``
before asking for item number ``freeze_after_items``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import torch

from afd_sdk.dispatch import AsyncDispatchConnector
from afd_sdk.runtime.session import connector_from_spec
from afd_sdk.runtime.world import worker_main
from afd_sdk.wire import TransferMetadata

__all__ = ["expert_fn", "routing", "run"]


def expert_fn(x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """The test experts: ``x * (e + 1) + e`` per row, bit-identical in any batch."""
    e = expert_ids.to(x.dtype).unsqueeze(-1)
    return x * (e + 1) + e


def routing(plan: str, n: int, num_experts: int, top_k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_ids, topk_weights)`` of ``n`` tokens for ``plan``."""
    if plan == "skewed":
        ids = torch.arange(top_k).expand(n, top_k).clone()
    else:
        ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(n)]) if n else None
        ids = ids if ids is not None else torch.empty(0, top_k, dtype=torch.long)
    return ids.long(), torch.rand(n, top_k, generator=g)


def _connector(spec: dict[str, Any]) -> AsyncDispatchConnector:
    m = spec["moe"]
    model = {
        "architecture": "DispatchCheck",
        "hidden_size": spec["hidden"],
        "dtype": "float32",
        "num_layers": max(m["layers"]) + 1,
    }
    conn = connector_from_spec({**spec, "model": model})
    if not isinstance(conn, AsyncDispatchConnector):
        raise TypeError(f"{type(conn).__name__} is not an AsyncDispatchConnector")
    return conn


def run(spec: dict[str, Any], out: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    conn = _connector(spec)
    m = spec["moe"]
    try:
        conn.init()
        if spec["role"] == "ffn":
            items = []
            stages = conn.config.num_stages
            stage = 0
            for served in range(spec.get("max_items", 10_000)):
                if served == spec.get("freeze_after_items"):
                    time.sleep(0.2)  # the last item's output leaves on gloo's thread: let it go before freezing
                    _freeze(spec["freeze_s"])  # idle: the next item not asked for
                item = conn.recv_ffn_work_item(stage)
                if item is None:
                    break
                if served == spec.get("die_after_items"):
                    os._exit(3)  # an FFN rank that dies holding a work item
                ids = torch.repeat_interleave(torch.arange(len(item.group_list)) + item.expert_start, item.group_list)
                if int(item.group_list.sum()) != item.num_tokens:
                    raise AssertionError(f"group_list {item.group_list.tolist()} != {item.num_tokens} rows")
                conn.send_ffn_work_item_output(item, expert_fn(item.hidden_states, ids))
                items.append([item.layer_idx, item.stage_idx, item.num_tokens, list(item.peer_tokens)])
                stage = (stage + 1) % stages
            out["items"] = items
            return
        g = torch.Generator().manual_seed(1000 + spec["rank"])
        max_diff, checks = 0.0, 0
        stages = conn.config.num_stages
        for step in range(spec.get("steps", 2)):
            if step:
                _between_steps(spec)
            for layer in m["layers"]:
                if spec.get("die_at") == [step, layer]:
                    os._exit(3)  # a peer that dies mid-exchange
                sent = []  # every stage in flight at once: dispatches queue FIFO per stage
                for stage in range(stages):
                    n = 0 if spec["plan"] == "empty" else spec["tokens"] + stage
                    x = torch.randn(n, spec["hidden"], generator=g)
                    ids, w = routing(spec["plan"], n, m["num_experts"], m["top_k"], g)
                    conn.send_attn_output(x, TransferMetadata(layer, stage, (n,)), topk_ids=ids, topk_weights=w)
                    sent.append((x, ids, w))
                for stage, (x, ids, w) in enumerate(sent):
                    got = conn.recv_ffn_output(x, stage)
                    n = x.shape[0]
                    expert_out = expert_fn(x.repeat_interleave(m["top_k"], 0), ids.reshape(-1))
                    want = (expert_out.view(n, m["top_k"], spec["hidden"]) * w.unsqueeze(-1)).sum(1)
                    max_diff = max(max_diff, float((got - want).abs().max()) if n else 0.0)
                    checks += 1
        out["max_abs_diff"] = max_diff
        out["checks"] = checks
    finally:
        conn.close()


def _between_steps(spec: dict[str, Any]) -> None:
    """An engine without requests: idle for ``pause_s``, or frozen for ``freeze_s`` (a resumer is started first)."""
    if spec.get("pause_s"):
        time.sleep(spec["pause_s"])
    if spec.get("freeze_s"):
        _freeze(spec["freeze_s"])


def _freeze(seconds: float) -> None:
    """SIGSTOP this process; a ``sh`` started first resumes it after ``seconds``."""
    subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"])
    os.kill(os.getpid(), signal.SIGSTOP)


if __name__ == "__main__":
    sys.exit(worker_main(run, sys.argv))
