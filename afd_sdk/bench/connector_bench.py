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
* ``shm``: the native shared-memory ring under ``ShmAFDConnector``
  (``afd_connectors._shmring``) driven directly: one copy into the slot per
  direction, the FFN echoes straight from its input slot, the spin-then-futex
  doorbell, no connector API — the same-host floor of that design;
* ``memcpy``: one in-process copy of the payload each way (the floor for a
  same-host transport).

After the sizes, one more round trip measures how much CPU an idle FFN rank
burns: the Attention rank sleeps ``idle_s`` before sending, and the FFN rank
reports its process CPU time over that wait as ``idle_cpu_pct`` (% of one core).
"""

from __future__ import annotations

import datetime
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["DEFAULT_BASELINES", "RAW_BASELINES", "iterations_for", "main", "parse_size", "run_benchmark"]

HIDDEN = 1024  # fp32 -> 4 KiB per token
DEFAULT_BASELINES = {
    "ZmqAFDConnector": ("zmq",),
    "P2pNcclAFDConnector": ("gloo",),
    "ShmAFDConnector": ("gloo", "zmq", "shm", "memcpy"),
    "CAMAsyncAFDConnector": ("gloo",),
}
#: every raw baseline the benchmark knows
RAW_BASELINES = ("zmq", "gloo", "shm", "memcpy")
IDLE_S = 1.0
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


class RawShm:
    """ShmAFDConnector's ring without the connector: one single-slot ring each way in one segment.

    Layout: ``[a2f counters (4 lines)][f2a counters (4 lines)][a2f slot][f2a slot]``, counters as in
    the connector (published, released, reader asleep, writer asleep); a slot is a 64-byte meta line
    plus the payload.
    """

    _SPIN_NS = 50_000
    _SLICE_NS = 20_000_000

    def __init__(self, role: str, port: int, max_bytes: int, timeout_s: float) -> None:
        from afd_connectors import _shmring

        self.ring = _shmring
        self.timeout_s = timeout_s
        self.path = f"/dev/shm/afd-bench-{port}"
        slot = 64 + -(-max_bytes // 64) * 64
        size = 512 + 2 * slot
        if role == "ffn":
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
        else:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fd = os.open(self.path, os.O_RDWR)
                    break
                except FileNotFoundError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{self.path} did not appear within {timeout_s:g}s") from None
                    time.sleep(0.001)
        try:
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if role == "attention":
            os.unlink(self.path)  # both mapped it: nothing stays in /dev/shm
        self.seg: torch.Tensor | None = torch.frombuffer(self.mm, dtype=torch.uint8)
        base = self.seg.data_ptr()
        # (published, released, reader asleep, writer asleep, slot) per direction
        self.a2f = (base, base + 64, base + 128, base + 192, base + 512)
        self.f2a = (base + 256, base + 320, base + 384, base + 448, base + 512 + slot)
        self.seq = 0

    def _wait(self, counter: int, want: int, asleep: int) -> None:
        if self.ring.wait_ge(counter, want, asleep, self._SPIN_NS, self._SLICE_NS):
            return
        deadline = time.monotonic() + self.timeout_s
        while not self.ring.wait_ge(counter, want, asleep, 0, self._SLICE_NS):
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw shm peer silent for {self.timeout_s:g}s")

    def _send(self, ring: tuple[int, int, int, int, int], seq: int, src: int, nbytes: int) -> None:
        published, released, reader_asleep, writer_asleep, slot = ring
        while not self.ring.write_slot(
            released, seq - 1, slot, seq, src, nbytes, 0, 0, 0, 1, 0, published, reader_asleep
        ):  # fmt: skip
            self._wait(released, seq - 1, writer_asleep)

    def attention_round_trip(self, payload: torch.Tensor) -> Callable[[], None]:
        src, nbytes = payload.data_ptr(), payload.nbytes
        a2f, f2a = self.a2f, self.f2a
        publish = self.ring.publish

        def rt() -> None:
            self.seq += 1
            seq = self.seq
            self._send(a2f, seq, src, nbytes)
            self._wait(f2a[0], seq, f2a[2])
            publish(f2a[1], seq, f2a[3])  # read in place: free the slot

        return rt

    def ffn_echo(self, count: int, nbytes: int) -> None:
        a2f, f2a = self.a2f, self.f2a
        for _ in range(count):
            self.seq += 1
            seq = self.seq
            self._wait(a2f[0], seq, a2f[2])
            self._send(f2a, seq, a2f[4] + 64, nbytes)  # echo straight from the input slot
            self.ring.publish(a2f[1], seq, a2f[3])

    def close(self) -> None:
        self.seg = None
        self.mm.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass  # the attention side unlinked it once both had mapped it


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
    if "shm" in baselines:
        raws["shm"] = RawShm(role, base + 2, max(spec["sizes"]), spec["afd"]["timeout_s"])
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
                    elif name == "shm":
                        raw.ffn_echo(per_block + 2, size)
                    else:
                        raw.ffn_echo(per_block + 2)
                _connector_block(conn, role, payload, step, per_block + 2, samples["connector"])
                step += 1
            if role == "attention":
                results.append({"size": size, "tokens": tokens, **{k: _stats(v, size) for k, v in samples.items()}})
        idle = _idle_probe(conn, role, step, float(spec.get("idle_s", IDLE_S)))
        if idle is not None:
            out["idle_cpu_pct"] = idle
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


def _idle_probe(conn: Any, role: str, step: int, idle_s: float) -> float | None:
    """One 1-token round trip after ``idle_s`` of silence; the FFN rank returns its CPU % over the wait."""
    from afd_sdk.connector import AsyncDispatchConnector
    from afd_sdk.wire import ControlPayload, TransferMetadata

    routed = isinstance(conn, AsyncDispatchConnector)
    cp = conn.control_plane
    if role == "attention":
        one = torch.randn(1, HIDDEN)
        if cp is not None:
            p = ControlPayload(step, ((1,),), 1, 1)
            cp.send(p)
            cp.apply(p)
        time.sleep(idle_s)
        md = TransferMetadata(0, 0, (1,))
        if routed:
            conn.send_attn_output(one, md, topk_ids=torch.zeros(1, 1, dtype=torch.long), topk_weights=torch.ones(1, 1))
        else:
            conn.send_attn_output(one, md)
        conn.recv_ffn_output(one, 0)
        return None
    if cp is not None:
        cp.apply(cp.recv())
    cpu0, wall0 = time.process_time(), time.monotonic()
    if routed:
        item = conn.recv_ffn_work_item(0)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        conn.send_ffn_work_item_output(item, item.hidden_states)
    else:
        a = conn.recv_attn_output(0)
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        conn.send_ffn_output(a.hidden_states, a.metadata)
    return 100.0 * cpu / wall


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
    (ffn,) = world.by_role("ffn")
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
        "idle_s": IDLE_S,
        "ffn_idle_cpu_pct": ffn.result.get("idle_cpu_pct"),
    }


def main(argv: list[str]) -> int:
    from afd_sdk.testing.harness import worker_main

    return worker_main(_worker, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
