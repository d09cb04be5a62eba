"""``afd bench connector``: connector round trip vs. the raw transport under it.

Two processes (one Attention, one FFN rank) on loopback. For every payload
size the Attention rank times round trips through the raw transport and then
through the connector, back to back in the same processes, so both see the
same machine state. The FFN rank echoes (no compute), so the numbers are pure
transport + SDK cost. A routed-dispatch connector (CAM) is measured with one
expert and top-1 routing, so every token travels to the FFN rank once and back
(dispatch header, expert sort, combine included) — the same bytes as the raw
round trip.

Raw baselines:

* ``zmq``: pyzmq DEALER/ROUTER over tcp, zero-copy ``send(copy=False)`` /
  ``recv(copy=False)``, no header;
* ``gloo``: a bare ``ProcessGroupGloo`` ``send``/``recv`` pair;
* ``memcpy``: one in-process copy of the payload each way (the floor for a
  same-host transport).
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DEFAULT_BASELINES", "iterations_for", "main", "parse_size", "run_benchmark"]

HIDDEN = 1024  # fp32 -> 4 KiB per token
DEFAULT_BASELINES = {
    "ZmqAFDConnector": ("zmq",),
    "P2pNcclAFDConnector": ("gloo",),
    "ShmAFDConnector": ("gloo", "zmq", "memcpy"),
    "CAMAsyncAFDConnector": ("gloo",),
}
_UNITS = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20}


def parse_size(text: str) -> int:
    """``"512K"`` -> 524288; a multiple of 4 KiB (one fp32 token of hidden 1024) is required."""
    from afd_sdk.errors import AFDConfigError

    t = text.strip().upper()
    num = t.rstrip("KMIB")
    unit = t[len(num) :]
    if not num.isdigit() or unit not in _UNITS:
        raise AFDConfigError(f"--sizes item {text!r} is invalid; expected e.g. 8K, 512K, 4M", key="sizes", value=text)
    size = int(num) * _UNITS[unit]
    if size <= 0 or size % (HIDDEN * 4):
        raise AFDConfigError(
            f"--sizes item {text!r} = {size} bytes; expected a positive multiple of 4K (one token of hidden {HIDDEN})",
            key="sizes",
            value=text,
        )
    return size


def iterations_for(size: int, iters: int) -> int:
    """Fewer round trips for big payloads: ``iters`` up to 512 KiB, then scaled down, at least 10."""
    return max(10, min(iters, iters * (512 * 1024) // size))


def _stats(samples_ns: list[int], size: int) -> dict[str, float]:
    us = sorted(s / 1000 for s in samples_ns)
    med = statistics.median(us)
    p90 = us[min(len(us) - 1, int(0.9 * len(us)))]
    return {"median_us": med, "p90_us": p90, "gbps": 2 * size / (med * 1e-6) / 1e9, "n": len(us)}


def _timed(fn: Callable[[], None], n: int, warmup: int = 5) -> list[int]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        out.append(time.perf_counter_ns() - t0)
    return out


# --- raw baselines ------------------------------------------------------------


class RawZmq:
    def __init__(self, role: str, host: str, port: int) -> None:
        import zmq

        self.zmq = zmq
        self.ctx = zmq.Context(io_threads=1)
        self.sock = self.ctx.socket(zmq.ROUTER if role == "ffn" else zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if role == "ffn":
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            self.sock.connect(f"tcp://{host}:{port}")

    def attention_round_trip(self, payload: torch.Tensor) -> Callable[[], None]:
        buf = memoryview(payload.view(torch.uint8).numpy())

        def rt() -> None:
            self.sock.send(buf, copy=False)
            self.sock.recv(copy=False)

        return rt

    def ffn_echo(self, count: int) -> None:
        for _ in range(count):
            ident, frame = self.sock.recv_multipart(copy=False)
            self.sock.send_multipart([ident, frame], copy=False)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


class RawGloo:
    def __init__(self, role: str, host: str, port: int, timeout_s: float) -> None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        rank = 0 if role == "ffn" else 1
        self.store = dist.TCPStore(host, port, 2, rank == 0, timeout=timeout)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("raw", self.store), rank, 2, timeout)
        self.peer = 1 - rank
        self.buf: torch.Tensor | None = None

    def attention_round_trip(self, payload: torch.Tensor) -> Callable[[], None]:
        back = torch.empty_like(payload)

        def rt() -> None:
            self.pg.send([payload], self.peer, 0).wait()
            self.pg.recv([back], self.peer, 0).wait()

        return rt

    def ffn_echo(self, count: int, numel: int) -> None:
        buf = torch.empty(numel, dtype=torch.float32)
        for _ in range(count):
            self.pg.recv([buf], self.peer, 0).wait()
            self.pg.send([buf], self.peer, 0).wait()

    def close(self) -> None:
        self.pg.shutdown()


def memcpy_round_trip(payload: torch.Tensor) -> Callable[[], None]:
    a, b = torch.empty_like(payload), torch.empty_like(payload)

    def rt() -> None:
        a.copy_(payload)
        b.copy_(a)

    return rt


# --- worker -------------------------------------------------------------------


def _worker(spec: dict[str, Any], out: dict[str, Any]) -> None:
    from afd_sdk.testing.worker import build_connector

    role = spec["role"]
    host, base = spec["afd"]["host"], spec["raw_port"]
    baselines = spec["baselines"]
    raws: dict[str, Any] = {}
    if "zmq" in baselines:
        raws["zmq"] = RawZmq(role, host, base)
    if "gloo" in baselines:
        raws["gloo"] = RawGloo(role, host, base + 1, spec["afd"]["timeout_s"])
    conn = build_connector(spec)
    conn.init()
    results: list[dict[str, Any]] = []
    blocks = int(spec.get("blocks", 10))
    step = 0
    try:
        for size in spec["sizes"]:
            tokens = size // (HIDDEN * 4)
            per_block = max(2, iterations_for(size, spec["iters"]) // blocks)
            payload = torch.randn(tokens, HIDDEN)
            samples: dict[str, list[int]] = {name: [] for name in (*raws, "connector")}
            if "memcpy" in baselines and role == "attention":
                samples["memcpy"] = _timed(memcpy_round_trip(payload), per_block * blocks)
            # alternate raw and connector blocks so both see the same machine state
            for _ in range(blocks):
                for name, raw in raws.items():
                    if role == "attention":
                        samples[name] += _timed(raw.attention_round_trip(payload.view(-1)), per_block, warmup=2)
                    elif name == "gloo":
                        raw.ffn_echo(per_block + 2, tokens * HIDDEN)
                    else:
                        raw.ffn_echo(per_block + 2)
                _connector_block(conn, role, payload, step, per_block + 2, samples["connector"])
                step += 1
            if role == "attention":
                results.append({"size": size, "tokens": tokens, **{k: _stats(v, size) for k, v in samples.items()}})
    finally:
        conn.close()
        for raw in raws.values():
            raw.close()
    out["rows"] = results


def _connector_block(conn: Any, role: str, payload: torch.Tensor, step: int, count: int, out: list[int]) -> None:
    """``count`` round trips through the connector as one step (2 warm-up trips not recorded)."""
    from afd_sdk.connector import AsyncDispatchConnector
    from afd_sdk.wire import ControlPayload, TransferMetadata

    if isinstance(conn, AsyncDispatchConnector):
        _dispatch_block(conn, role, payload, count, out)
        return
    cp = conn.control_plane
    if role == "attention":
        tokens = payload.shape[0]
        if cp is not None:
            p = ControlPayload(step, ((tokens,),), tokens, count)
            cp.send(p)
            cp.apply(p)
        for layer in range(count):
            md = TransferMetadata(layer, 0, (tokens,))
            t0 = time.perf_counter_ns()
            conn.send_attn_output(payload, md)
            conn.recv_ffn_output(payload, 0)
            if layer >= 2:
                out.append(time.perf_counter_ns() - t0)
    else:
        if cp is not None:
            cp.apply(cp.recv())
        for _ in range(count):
            a = conn.recv_attn_output(0)
            conn.send_ffn_output(a.hidden_states, a.metadata)


def _dispatch_block(conn: Any, role: str, payload: torch.Tensor, count: int, out: list[int]) -> None:
    """Routed round trips: top-1 to the single expert, echoed by the FFN rank, combined with weight 1."""
    from afd_sdk.wire import TransferMetadata

    if role == "attention":
        tokens = payload.shape[0]
        ids = torch.zeros(tokens, 1, dtype=torch.long)
        weights = torch.ones(tokens, 1)
        md = TransferMetadata(0, 0, (tokens,))
        for i in range(count):
            t0 = time.perf_counter_ns()
            conn.send_attn_output(payload, md, topk_ids=ids, topk_weights=weights)
            conn.recv_ffn_output(payload, 0)
            if i >= 2:
                out.append(time.perf_counter_ns() - t0)
    else:
        for _ in range(count):
            item = conn.recv_ffn_work_item(0)
            conn.send_ffn_work_item_output(item, item.hidden_states)


def run_benchmark(
    connector: str,
    sizes: list[int],
    *,
    iters: int = 200,
    baselines: tuple[str, ...] | None = None,
    extra_config: dict[str, Any] | None = None,
    timeout_s: float = 30.0,
) -> dict[str, Any]:
    """Run the two-process benchmark and return ``{"connector", "baselines", "rows"}``."""
    from afd_sdk.errors import AFDError
    from afd_sdk.plugins import get_plugin_manager
    from afd_sdk.testing.harness import free_port_block, run_world

    cls = get_plugin_manager().connector_class(connector)
    baselines = baselines if baselines is not None else DEFAULT_BASELINES.get(cls.name, ("zmq", "gloo"))
    port = free_port_block(32)
    spec = {
        "afd": {
            "connector": connector,
            "host": "127.0.0.1",
            "port": port,
            "timeout_s": timeout_s,
            "connector_extra_config": extra_config or {},
        },
        "model": {"architecture": "Bench", "hidden_size": HIDDEN, "dtype": "float32", "num_layers": 1},
        "max_num_tokens": max(sizes) // (HIDDEN * 4),
        "raw_port": port + 16,
        "baselines": list(baselines),
        "sizes": sizes,
        "iters": iters,
    }
    if cls.capabilities.async_dispatch:
        spec["afd"]["compute_gate_on_attention"] = True
        spec["moe"] = {"num_experts": 1, "top_k": 1, "layers": [0]}
    world = run_world(spec, module="afd_sdk.bench.connector_bench", timeout_s=600)
    (attn,) = world.by_role("attention")
    if not all(r.ok for r in world.ranks):
        raise AFDError(f"benchmark failed:\n{world.describe()}")
    for row in attn.result["rows"]:
        conn = row["connector"]["median_us"]
        for b in baselines:
            row[f"ratio_{b}"] = conn / row[b]["median_us"]
            row[f"delta_{b}_us"] = conn - row[b]["median_us"]
    return {
        "connector": cls.name,
        "baselines": list(baselines),
        "hidden": HIDDEN,
        "dtype": "float32",
        "rows": attn.result["rows"],
    }


def main(argv: list[str]) -> int:
    from afd_sdk.testing.harness import worker_main

    return worker_main(_worker, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
