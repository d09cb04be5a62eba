"""One rank of a conformance world: ``python -m afd_sdk.testing.worker SPEC_JSON``.

The spec (see :func:`afd_sdk.testing.harness.run_world`) names a scenario; the
worker builds the connector exactly as the runtime does — config parse, plugin
manager resolution, ``ConnectorContext`` — runs the scenario and writes a JSON
result. Data is deterministic, so both sides compute the expected FFN output
independently and compare bit-exactly.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import torch

from afd_sdk.adapter import resolve_target
from afd_sdk.config import parse_config
from afd_sdk.connector import AFDConnector, ConnectorContext, ExtraSpec, MoELayout
from afd_sdk.plugins import get_plugin_manager
from afd_sdk.testing.harness import worker_main
from afd_sdk.wire import A2FPayload, ControlPayload, ModelFingerprint, TransferMetadata, dtype_from_name

__all__ = ["build_connector", "ffn_function", "main"]


def build_connector(spec: dict[str, Any]) -> AFDConnector:
    """Resolve and construct (not init) the connector a spec describes."""
    cfg = parse_config({**spec["afd"], "role": spec["role"]})
    pm = get_plugin_manager()
    if spec.get("connector_target"):
        cls = resolve_target(spec["connector_target"], what="connector_target")
        extra = cls.parse_extra_config(cfg.connector_extra_config)
        cls.validate_config(cfg)
    else:
        resolved = pm.resolve_config(cfg)
        cls, extra = resolved.connector_cls, resolved.extra_config
    m = spec["model"]
    fingerprint = ModelFingerprint(
        m["architecture"],
        m["hidden_size"],
        m["dtype"],
        m["num_layers"],
        m.get("adapter", ""),
        m.get("adapter_version", ""),
    )
    extras = tuple(ExtraSpec(e["name"], e["dtype"], tuple(e.get("trailing_shape", ()))) for e in spec.get("extras", []))
    moe = spec.get("moe")
    layout = MoELayout(moe["num_experts"], moe["top_k"], tuple(moe["layers"])) if moe else None
    ctx = ConnectorContext(cfg, spec["rank"], fingerprint, extra, extras, spec.get("max_num_tokens", 4096), moe=layout)
    return cls(ctx)


def tokens_for(spec: dict[str, Any], rank: int, step: int, stage: int) -> int:
    plan = spec.get("tokens", [4])
    return int(plan[(rank * 7 + step * 3 + stage) % len(plan)])


def make_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, shape, generator=g, dtype=torch.int64).to(dtype)


def ffn_function(hidden: torch.Tensor, layer: int, extras: dict[str, torch.Tensor]) -> torch.Tensor:
    """The stand-in FFN: ``h + (layer+1) + first column of each extra``; exact in every dtype."""
    out = hidden + (layer + 1)
    for t in extras.values():
        first = t.flatten(1)[:, :1] if t.dim() > 1 else t.unsqueeze(1)  # reshape(n, -1) fails for n = 0
        out = out + first.to(out.dtype)
    return out


def _inputs(spec: dict[str, Any], conn: AFDConnector, step: int, stage: int, layer: int, n: int):
    dtype = dtype_from_name(spec["model"]["dtype"])
    seed = (((spec["rank"] * 1009 + step) * 101 + stage) * 1013 + layer) * 7
    h = make_tensor((n, spec["model"]["hidden_size"]), dtype, seed)
    extras = {
        e.name: make_tensor((n, *e.trailing_shape), dtype_from_name(e.dtype), seed + 1 + i)
        for i, e in enumerate(conn.context.ffn_extras)
    }
    return h, extras


def drive_attention(spec: dict[str, Any], conn: AFDConnector, steps: int, stats: dict[str, Any]) -> None:
    num_layers, num_stages = spec["model"]["num_layers"], conn.config.num_stages
    die = spec.get("die") or {}
    for step in range(steps):
        counts = [tokens_for(spec, spec["rank"], step, s) for s in range(num_stages)]
        payload = ControlPayload(step, tuple((c,) for c in counts), max(counts), num_layers)
        if conn.control_plane is not None:
            conn.control_plane.send(payload)
            conn.control_plane.apply(payload)
        for layer in range(num_layers):
            sent = {}
            for s in range(num_stages):
                h, ex = _inputs(spec, conn, step, s, layer, counts[s])
                conn.send_attn_output(h, TransferMetadata(layer, s, (counts[s],)), extras=ex or None)
                sent[s] = (h, ex)
            if die.get("role") == "attention" and die.get("at_layer") == layer:
                os.kill(os.getpid(), signal.SIGKILL)
            for s in range(num_stages):
                h, ex = sent[s]
                stats["waiting_since"] = time.monotonic()
                out = conn.recv_ffn_output(h, s)
                want = ffn_function(h, layer, ex)
                if not torch.equal(out, want):
                    raise AssertionError(f"step {step} layer {layer} stage {s}: ffn output differs from expected")
                stats["checks"] = stats.get("checks", 0) + 1


def drive_ffn(spec: dict[str, Any], conn: AFDConnector, steps: int, stats: dict[str, Any]) -> None:
    num_layers, num_stages = spec["model"]["num_layers"], conn.config.num_stages
    die = spec.get("die") or {}
    step = 0
    while True:
        cp = conn.control_plane
        counts = None
        if cp is not None:
            stats["waiting_since"] = time.monotonic()
            payload = cp.recv()
            if payload is None:
                break
            cp.apply(payload)
            num_layers, num_stages, counts = payload.num_layers, payload.num_stages, payload.stage_token_counts
        elif step == steps:
            break
        for layer in range(num_layers):
            for s in range(num_stages):
                stats["waiting_since"] = time.monotonic()
                a: A2FPayload = conn.recv_attn_output(s)
                if (a.metadata.layer_idx, a.metadata.stage_idx) != (layer, s):
                    raise AssertionError(
                        f"got layer/stage {(a.metadata.layer_idx, a.metadata.stage_idx)}; expected {(layer, s)}"
                    )
                if counts is not None and tuple(a.metadata.seq_lens) != tuple(counts[s]):
                    raise AssertionError(f"seq_lens {a.metadata.seq_lens} differ from announced {counts[s]}")
                if die.get("role") == "ffn" and die.get("at_layer") == layer:
                    os.kill(os.getpid(), signal.SIGKILL)
                if spec.get("scenario") == "local_errors" and step == 0 and layer == 0 and s == 0:
                    wrong = torch.zeros(
                        a.metadata.num_tokens + 1, a.hidden_states.shape[1], dtype=a.hidden_states.dtype
                    )
                    _expect_error(stats, "ffn_wrong_rows", lambda w=wrong, m=a.metadata: conn.send_ffn_output(w, m))
                conn.send_ffn_output(ffn_function(a.hidden_states, layer, a.extras), a.metadata)
                stats["checks"] = stats.get("checks", 0) + 1
        step += 1


def _expect_error(stats: dict[str, Any], label: str, fn: Any) -> None:
    try:
        fn()
    except Exception as exc:
        stats.setdefault("expected_errors", {})[label] = [type(exc).__name__, str(exc)]
        return
    stats.setdefault("expected_errors", {})[label] = ["no error", ""]


def local_errors(spec: dict[str, Any], conn: AFDConnector, stats: dict[str, Any]) -> None:
    """Attention-side misuse must raise clear errors and leave the connector usable."""
    hidden = spec["model"]["hidden_size"]
    dtype = dtype_from_name(spec["model"]["dtype"])
    n = 3
    payload = ControlPayload(0, ((n,),) * conn.config.num_stages, n, spec["model"]["num_layers"])
    _expect_error(stats, "recv_before_send", lambda: conn.recv_ffn_output(torch.zeros(n, hidden, dtype=dtype), 0))
    if conn.control_plane is not None:
        conn.control_plane.send(payload)
        conn.control_plane.apply(payload)
    _, ex = _inputs(spec, conn, 0, 0, 0, n)
    bad = torch.zeros(n, hidden + 1, dtype=dtype)
    _expect_error(
        stats, "wrong_hidden_size", lambda: conn.send_attn_output(bad, TransferMetadata(0, 0, (n,)), extras=ex or None)
    )
    good = torch.zeros(n, hidden, dtype=dtype)
    _expect_error(
        stats,
        "seq_lens_mismatch",
        lambda: conn.send_attn_output(good, TransferMetadata(0, 0, (n + 1,)), extras=ex or None),
    )
    _expect_error(
        stats,
        "stage_out_of_range",
        lambda: conn.send_attn_output(good, TransferMetadata(0, 99, (n,)), extras=ex or None),
    )
    if conn.context.ffn_extras:
        _expect_error(stats, "missing_extras", lambda: conn.send_attn_output(good, TransferMetadata(0, 0, (n,))))
    # still usable: one full, checked step with the payload already announced
    for layer in range(spec["model"]["num_layers"]):
        sent = {}
        for s in range(conn.config.num_stages):
            h, e = _inputs(spec, conn, 0, s, layer, n)
            conn.send_attn_output(h, TransferMetadata(layer, s, (n,)), extras=e or None)
            sent[s] = (h, e)
        for s in range(conn.config.num_stages):
            h, e = sent[s]
            if not torch.equal(conn.recv_ffn_output(h, s), ffn_function(h, layer, e)):
                raise AssertionError("connector returned a wrong result after rejecting bad input")
            stats["checks"] = stats.get("checks", 0) + 1


def resources() -> dict[str, int]:
    """Open fds and native threads of this process (zmq / gloo threads included)."""
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "py_threads": threading.active_count(),
    }


def run(spec: dict[str, Any], stats: dict[str, Any]) -> None:
    scenario = spec["scenario"]
    role = spec["role"]
    steps = int(spec.get("steps", 2))
    conn = build_connector(spec)
    if scenario == "lifecycle":
        stats["before"] = resources()
        for cycle in range(int(spec.get("cycles", 2))):
            conn.init()
            (drive_attention if role == "attention" else drive_ffn)(spec, conn, 1, stats)
            conn.close()
            conn.close()  # idempotent
            if cycle == 0:
                stats["after_first"] = resources()
            if role == "attention":
                time.sleep(0.2)  # let the ffn side re-bind before reconnecting
        stats["after"] = resources()
        stats["is_initialized_after_close"] = conn.is_initialized
        return
    if scenario == "init_fails":
        t0 = time.monotonic()
        try:
            conn.init()
        except Exception as exc:
            stats["init_error"] = [type(exc).__name__, str(exc), time.monotonic() - t0]
        conn.close()
        conn.close()
        stats["after"] = resources()
        return
    t0 = time.monotonic()
    try:
        conn.init()
        stats["init_s"] = time.monotonic() - t0
        if scenario == "local_errors" and role == "attention":
            local_errors(spec, conn, stats)
        else:
            (drive_attention if role == "attention" else drive_ffn)(spec, conn, steps, stats)
    finally:
        conn.close()


def _run(spec: dict[str, Any], out: dict[str, Any]) -> None:
    try:
        run(spec, out)
    except Exception:
        if "waiting_since" in out:
            # how long the survivor waited before its error (checked against the deadline)
            out["error_after_wait_s"] = time.monotonic() - out.pop("waiting_since")
        raise
    out.pop("waiting_since", None)


def main(argv: list[str]) -> int:
    return worker_main(_run, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
