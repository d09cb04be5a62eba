"""One rank of a conformance world: ``python -m afd_sdk.testing.worker SPEC_JSON``.

The spec (see :func:`afd_sdk.runtime.world.run_world`) names a scenario; the
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

from afd_sdk.connector import AFDConnector
from afd_sdk.runtime.attention_runner import announce_step
from afd_sdk.runtime.ffn_server import FFNServer
from afd_sdk.runtime.session import connector_from_spec
from afd_sdk.runtime.world import worker_main
from afd_sdk.wire import A2FPayload, ControlPayload, TransferMetadata, dtype_from_name

__all__ = ["ffn_function", "main"]


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


#: scenario ``static_buffers``: (stage, form) -> this rank's buffer that hidden states are sent from, every layer
_STATIC: dict[tuple[int, int], torch.Tensor] = {}
#: rows in front of the view sent from the second static buffer (a view whose storage starts elsewhere)
STATIC_OFFSET_ROWS = 3


def _placed(spec: dict[str, Any], stage: int, layer: int, h: torch.Tensor) -> torch.Tensor:
    """``h`` as the scenario sends it: itself, or (``static_buffers``) copied into a buffer reused every layer.

    Layers alternate between a fresh tensor, the start of a static buffer, and a
    view ``STATIC_OFFSET_ROWS`` rows into another static buffer. The caller
    refills a buffer only after ``recv_ffn_output`` of its stage returned, as
    the contract allows, so a connector must send what the memory holds now.
    """
    form = layer % 3
    if spec.get("scenario") != "static_buffers" or form == 0:
        return h
    rows = max(spec.get("tokens", [4])) + STATIC_OFFSET_ROWS
    buf = _STATIC.get((stage, form))
    if buf is None or buf.dtype != h.dtype:
        buf = _STATIC[(stage, form)] = torch.zeros(rows, *h.shape[1:], dtype=h.dtype)
    start = 0 if form == 1 else STATIC_OFFSET_ROWS
    view = buf[start : start + h.shape[0]]
    view.copy_(h)
    return view


def drive_attention(spec: dict[str, Any], conn: AFDConnector, steps: int, stats: dict[str, Any]) -> None:
    num_layers, num_stages = spec["model"]["num_layers"], conn.config.num_stages
    die = spec.get("die") or {}
    for step in range(steps):
        counts = [tokens_for(spec, spec["rank"], step, s) for s in range(num_stages)]
        announce_step(conn, ControlPayload(step, tuple((c,) for c in counts), max(counts), num_layers))
        _checked_step(spec, conn, stats, step, counts, die.get("at_layer") if die.get("role") == "attention" else None)


def _checked_step(
    spec: dict[str, Any],
    conn: AFDConnector,
    stats: dict[str, Any],
    step: int,
    counts: list[int],
    die_at_layer: int | None = None,
) -> None:
    """One announced step: per layer every stage sent, then every stage received and checked value-exact.

    ``die_at_layer``: this process kills itself once that layer is sent (a peer killed mid-step).
    """
    for layer in range(spec["model"]["num_layers"]):
        sent = {}
        for s, n in enumerate(counts):
            h, ex = _inputs(spec, conn, step, s, layer, n)
            conn.send_attn_output(_placed(spec, s, layer, h), TransferMetadata(layer, s, (n,)), extras=ex or None)
            sent[s] = (h, ex)
        if die_at_layer == layer:
            os.kill(os.getpid(), signal.SIGKILL)
        for s in range(len(counts)):
            h, ex = sent[s]
            stats["waiting_since"] = time.monotonic()
            out = conn.recv_ffn_output(h, s)
            if not torch.equal(out, ffn_function(h, layer, ex)):
                raise AssertionError(f"step {step} layer {layer} stage {s}: ffn output differs from expected")
            stats["checks"] = stats.get("checks", 0) + 1


def drive_ffn(spec: dict[str, Any], conn: AFDConnector, stats: dict[str, Any]) -> None:
    """Serve with the runtime's own ``FFNServer`` and a stand-in FFN.

    Every payload the server receives is checked on the way in: it must be
    the next (layer, stage) of the announced step, with exactly the announced
    per-peer token counts in fan-in order.
    """
    die = spec.get("die") or {}
    recv = conn.recv_attn_output
    seen: dict[str, Any] = {"payload": None, "i": 0}

    def checked_recv(stage_idx: int = 0) -> A2FPayload:
        stats["waiting_since"] = time.monotonic()
        a = recv(stage_idx)
        payload = conn.control_plane.current  # type: ignore[union-attr]
        if payload is not seen["payload"]:
            seen["payload"], seen["i"] = payload, 0
        i = seen["i"]
        seen["i"] = i + 1
        want = (i // payload.num_stages, i % payload.num_stages)
        if (a.metadata.layer_idx, a.metadata.stage_idx) != want or stage_idx != want[1]:
            raise AssertionError(f"got layer/stage {(a.metadata.layer_idx, a.metadata.stage_idx)}; expected {want}")
        if tuple(a.metadata.seq_lens) != tuple(payload.stage_token_counts[stage_idx]):
            raise AssertionError(
                f"seq_lens {a.metadata.seq_lens} differ from announced {payload.stage_token_counts[stage_idx]}"
            )
        if die.get("role") == "ffn" and die.get("at_layer") == a.metadata.layer_idx:
            os.kill(os.getpid(), signal.SIGKILL)
        # local_errors: a wrong output before the first exchange, and again once a whole step ran
        done = stats.get("checks", 0)
        if spec.get("scenario") == "local_errors" and done in (0, payload.num_layers * payload.num_stages):
            wrong = torch.zeros(a.metadata.num_tokens + 1, a.hidden_states.shape[1], dtype=a.hidden_states.dtype)
            label = "ffn_wrong_rows" if done == 0 else "ffn_wrong_rows_steady"
            _expect_error(stats, label, lambda: conn.send_ffn_output(wrong, a.metadata))
        return a

    def ffn(layer: int, hidden: torch.Tensor, extras: Any) -> torch.Tensor:
        stats["checks"] = stats.get("checks", 0) + 1
        out = ffn_function(hidden, layer, extras)
        if spec.get("scenario") == "static_buffers" and layer % 2:
            # a view STATIC_OFFSET_ROWS rows into a fresh buffer: its storage starts before the output
            big = torch.empty(out.shape[0] + STATIC_OFFSET_ROWS, *out.shape[1:], dtype=out.dtype)
            big[STATIC_OFFSET_ROWS:].copy_(out)
            return big[STATIC_OFFSET_ROWS:]
        return out

    conn.recv_attn_output = checked_recv  # type: ignore[method-assign]  # the server's loop, checked inputs
    stats["waiting_since"] = time.monotonic()
    try:
        FFNServer(conn, ffn).serve()
    finally:
        del conn.recv_attn_output


def _expect_error(stats: dict[str, Any], label: str, fn: Any) -> None:
    try:
        fn()
    except Exception as exc:
        stats.setdefault("expected_errors", {})[label] = [type(exc).__name__, str(exc)]
        return
    stats.setdefault("expected_errors", {})[label] = ["no error", ""]


def local_errors(spec: dict[str, Any], conn: AFDConnector, stats: dict[str, Any]) -> None:
    """Attention side of ``local_errors``: each misuse once before any exchange and once more after a whole step.

    The second round catches a connector that memoises its checks for inputs seen before and skips one it
    still owes. Each round is followed by one full, checked step: a refused call leaves the connector usable.
    """
    for step, suffix in ((0, ""), (1, "_steady")):
        _misuse_then_step(spec, conn, stats, step, suffix)


def _misuse_then_step(spec: dict[str, Any], conn: AFDConnector, stats: dict[str, Any], step: int, suffix: str) -> None:
    hidden = spec["model"]["hidden_size"]
    dtype = dtype_from_name(spec["model"]["dtype"])
    n = 3
    num_stages, num_layers = conn.config.num_stages, spec["model"]["num_layers"]
    good = torch.zeros(n, hidden, dtype=dtype)
    bad = torch.zeros(n, hidden + 1, dtype=dtype)
    _expect_error(stats, f"recv_before_send{suffix}", lambda: conn.recv_ffn_output(good, 0))
    announce_step(conn, ControlPayload(step, ((n,),) * num_stages, n, num_layers))
    _, ex = _inputs(spec, conn, 0, 0, 0, n)
    extras = ex or None
    _expect_error(
        stats,
        f"wrong_hidden_size{suffix}",
        lambda: conn.send_attn_output(bad, TransferMetadata(0, 0, (n,)), extras=extras),
    )
    _expect_error(
        stats,
        f"seq_lens_mismatch{suffix}",
        lambda: conn.send_attn_output(good, TransferMetadata(0, 0, (n + 1,)), extras=extras),
    )
    _expect_error(
        stats,
        f"stage_out_of_range{suffix}",
        lambda: conn.send_attn_output(good, TransferMetadata(0, 99, (n,)), extras=extras),
    )
    if conn.context.ffn_extras:
        md = TransferMetadata(0, 0, (n,))
        _expect_error(stats, f"missing_extras{suffix}", lambda: conn.send_attn_output(good, md))
    # still usable: one full, checked step with the payload already announced
    _checked_step(spec, conn, stats, step, [n] * num_stages)


def resources() -> dict[str, int]:
    """Open fds and native threads of this process (zmq / gloo threads included)."""
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "py_threads": threading.active_count(),
    }


def settled_resources(
    expect: dict[str, int] | None = None, timeout_s: float = 2.0, interval_s: float = 0.05
) -> dict[str, int]:
    """:func:`resources` once it equals ``expect``, or (without one) once two readings ``interval_s`` apart agree;
    the last reading after ``timeout_s``.

    ``Thread.join()`` and ``pthread_join`` (libzmq's and Gloo's threads) return before the kernel drops the
    thread from ``/proc/self/task``, so a reading right after ``close()`` can count a thread that is already gone.
    Once in CI, under the whole suite's load, the TCP reference connector's second init/close cycle read one
    thread more than its first; alone, 6 reruns read the same count. A leaked thread stays, so the comparison
    still catches it (at the cost of ``timeout_s``).
    """
    last = resources()
    deadline = time.monotonic() + timeout_s
    while last != expect and time.monotonic() < deadline:
        time.sleep(interval_s)
        now = resources()
        if expect is None and now == last:
            return now
        last = now
    return last


def run(spec: dict[str, Any], stats: dict[str, Any]) -> None:
    scenario = spec["scenario"]
    role = spec["role"]
    steps = int(spec.get("steps", 2))
    conn = connector_from_spec(spec)
    if not isinstance(conn, AFDConnector):
        raise TypeError(f"{type(conn).__name__} is no AFDConnector; routed dispatch has its own suite")
    if scenario == "lifecycle":
        stats["before"] = settled_resources()
        for cycle in range(int(spec.get("cycles", 2))):
            conn.init()
            drive_attention(spec, conn, 1, stats) if role == "attention" else drive_ffn(spec, conn, stats)
            conn.close()
            conn.close()  # idempotent
            if cycle == 0:
                stats["after_first"] = settled_resources()
            if role == "attention":
                time.sleep(0.2)  # let the ffn side re-bind before reconnecting
        stats["after"] = settled_resources(expect=stats["after_first"])
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
            drive_attention(spec, conn, steps, stats) if role == "attention" else drive_ffn(spec, conn, stats)
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
