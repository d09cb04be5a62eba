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
* any raw transport a connector declares in ``raw_baselines`` (name ->
  ``"module:Class"``), e.g. ``shm``: ``ShmAFDConnector``'s native ring driven
  directly (``afd_connectors.shm.raw``), the same-host floor of that design;
  ``wire``: ``ZmqAFDConnector``'s own native wire and receive tensors without
  its contract (``afd_connectors.zmq.raw``); ``posted``:
  ``P2pNcclAFDConnector``'s order of Gloo calls without its contract
  (``afd_connectors.p2p.raw``). Against these two, ``connector ÷ baseline`` is
  what the connector's checks and bookkeeping cost.
  A raw transport is constructed as ``Class(role, host=, port=, max_bytes=,
  timeout_s=)``, plus ``extra=`` (the run's ``connector_extra_config``) when
  its constructor takes it, so that it can drive the geometry the connector
  runs with (``shm``: the ring's ``slots`` and adaptive spin). It offers
  ``attention_round_trip(payload) -> callable``,
  ``ffn_echo(count, nbytes)`` and ``close()``; it lives with its connector
  because it may use the connector's internals;
* ``memcpy``: one in-process copy of the payload each way (the floor for a
  same-host transport).

After the sizes, one more round trip measures how much CPU an idle FFN rank
burns: the Attention rank sleeps ``idle_s`` before sending, and the FFN rank
reports its process CPU time over that wait as ``idle_cpu_pct`` (% of one core).
"""

from __future__ import annotations

import inspect
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from afd_sdk.bench.roundtrip_profile import profile_attention, profile_ffn, wake_penalty
from afd_sdk.metrics import AFDMetrics

__all__ = [
    "RAW_BASELINES",
    "check_baselines",
    "iterations_for",
    "main",
    "parse_size",
    "run_benchmark",
]

HIDDEN = 1024  # fp32 -> 4 KiB per token
#: the raw baselines the benchmark itself knows (connectors add theirs through ``raw_baselines``)
RAW_BASELINES = ("zmq", "gloo", "memcpy")
IDLE_S = 1.0
#: the column of the connector with metrics recording on (``--metrics``)
METERED = "connector+metrics"
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
    """Fewer round trips for big payloads: ``iters`` up to 1 MiB, then scaled down, at least 10.

    Not by more: a 4 MiB round trip over Gloo or ZMQ on loopback is bimodal (p90 ~1.6x its median), so
    its median needs samples. With an eighth of 2000 (250), p2p's connector read 0.93-1.35x raw Gloo at
    4 MiB over 3 runs; with a quarter (500), 0.91-0.93x.
    """
    return max(10, min(iters, iters * (1024 * 1024) // size))


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
    def __init__(self, role: str, *, host: str, port: int, max_bytes: int, timeout_s: float) -> None:
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

    def ffn_echo(self, count: int, nbytes: int) -> None:
        for _ in range(count):
            ident, frame = self.sock.recv_multipart(copy=False)
            self.sock.send_multipart([ident, frame], copy=False)

    def close(self) -> None:
        from afd_sdk.control.endpoint import terminate_context

        self.sock.close()
        terminate_context(self.ctx, "the raw ZMQ baseline", linger_s=0.0)


class RawGloo:
    def __init__(self, role: str, *, host: str, port: int, max_bytes: int, timeout_s: float) -> None:
        from afd_sdk.control import open_tcp_store, stage_groups

        rank = 0 if role == "ffn" else 1
        # bound like the connector's own store and group, so the two are compared on the same sockets
        self.store = open_tcp_store(host, port, 2, rank == 0, timeout_s, "raw gloo")
        (self.pg,) = stage_groups(self.store, "raw", rank, 2, "gloo", timeout_s, 1, host=host, port=port)
        self.peer = 1 - rank
        self.buf: torch.Tensor | None = None

    def attention_round_trip(self, payload: torch.Tensor) -> Callable[[], None]:
        back = torch.empty_like(payload)

        def rt() -> None:
            self.pg.send([payload], self.peer, 0).wait()
            self.pg.recv([back], self.peer, 0).wait()

        return rt

    def ffn_echo(self, count: int, nbytes: int) -> None:
        buf = torch.empty(nbytes // 4, dtype=torch.float32)
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


_BUILTIN_RAW: dict[str, Any] = {"zmq": RawZmq, "gloo": RawGloo}


def raw_transport_class(name: str, connector_cls: Any) -> Any:
    """The raw transport class of baseline ``name``: the benchmark's own, or one the connector declares."""
    from afd_sdk.adapter import resolve_target

    target = connector_cls.raw_baselines.get(name)
    if target is None:  # one of the benchmark's own (declared as None, or asked for with --raw)
        return _BUILTIN_RAW[name]
    return resolve_target(target, what=f"{connector_cls.name} raw baseline {name!r}")


def _worker(spec: dict[str, Any], out: dict[str, Any]) -> None:
    from afd_sdk.runtime.heap import freeze_startup_heap
    from afd_sdk.runtime.session import connector_from_spec

    role = spec["role"]
    host, base = spec["afd"]["host"], spec["raw_port"]
    conn = connector_from_spec(spec)
    raws: dict[str, Any] = {}
    extra = spec["afd"].get("connector_extra_config") or {}
    for i, name in enumerate(b for b in spec["baselines"] if b != "memcpy"):
        cls = raw_transport_class(name, type(conn))
        # a connector's own raw transport may run the connector's geometry (shm: its slots and spin)
        kw = {"extra": extra} if "extra" in inspect.signature(cls).parameters else {}
        raws[name] = cls(
            role, host=host, port=base + i, max_bytes=max(spec["sizes"]), timeout_s=spec["afd"]["timeout_s"], **kw
        )
    # with metrics: a third column, the connector recording every exchange as the runtime does
    rec = None
    if spec.get("metrics"):
        from afd_sdk.metrics import MetricsHub

        rec = MetricsHub().recorder(connector=conn.display_name, role=role, rank=0, port=0, num_stages=1)
    conn.init()
    freeze_startup_heap()  # a full collection of the start-up heap inside a block reads as an 80 ms round trip
    # which data path was measured, for a connector that has more than one (zmq's and p2p's ``wire_name``)
    out["wire"] = getattr(conn, "wire_name", None)
    results: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    blocks = int(spec.get("blocks", 10))
    step = 0
    try:
        # inference mode, as the runtime makes every exchange: under autograd tracking a tensor view or slice
        # costs 2-3x more, which the raw loops (no tensor ops) would not pay
        with torch.inference_mode():
            for size in spec["sizes"]:
                tokens = size // (HIDDEN * 4)
                per_block = max(2, iterations_for(size, spec["iters"]) // blocks)
                payload = torch.randn(tokens, HIDDEN)
                samples: dict[str, list[int]] = {name: [] for name in (*raws, "connector")}
                if rec is not None:
                    samples[METERED] = []
                if "memcpy" in spec["baselines"] and role == "attention":
                    samples["memcpy"] = _timed(memcpy_round_trip(payload), per_block * blocks)
                # each layer's first use (plans built, full checks; a serving step pays it once per (layer, tokens)
                # shape) in a block of its own, so that the timed blocks measure the steady state, as the raw
                # loops do: otherwise one block in ten ran the first-use path and set the p90 (shm, 8 KiB: 12.6 µs
                # per round trip against 2.4)
                first_use: list[int] = []
                _connector_block(conn, role, payload, step, per_block + 2, first_use)
                step += 1
                # alternate raw and connector blocks so both see the same machine state
                for _ in range(blocks):
                    for name, raw in raws.items():
                        if role == "attention":
                            samples[name] += _timed(raw.attention_round_trip(payload.view(-1)), per_block, warmup=2)
                        else:
                            raw.ffn_echo(per_block + 2, size)
                    _connector_block(conn, role, payload, step, per_block + 2, samples["connector"])
                    step += 1
                    if rec is not None:
                        _connector_block(conn, role, payload, step, per_block + 2, samples[METERED], rec)
                        step += 1
                prof = _profile_size(conn, role, raws, payload, step, per_block) if spec.get("profile") else None
                step += 2  # the profile runs two steps
                if role == "attention":
                    row = {"size": size, "tokens": tokens, **{k: _stats(v, size) for k, v in samples.items()}}
                    row["connector_first_use"] = _stats(first_use, size)
                    results.append(row if prof is None else {**row, "profile": prof})
                elif prof is not None:
                    profiles[str(size)] = prof
            idle = _idle_probe(conn, role, step, float(spec.get("idle_s", IDLE_S)))
            if idle is not None:
                out["idle_cpu_pct"] = idle
            if spec.get("profile"):
                out["profile"] = profiles
                out["wake_penalty"] = wake_penalty()
            if rec is not None:
                out["recording_ns"] = recording_cost_ns(role)
                out["recorded_exchanges"] = rec.exchanges
    finally:
        conn.close()
        for raw in raws.values():
            raw.close()
    out["rows"] = results


def _connector_block(
    conn: Any, role: str, payload: torch.Tensor, step: int, count: int, out: list[int], rec: AFDMetrics | None = None
) -> None:
    """``count`` round trips through the connector as one step (2 warm-up trips not recorded).

    The FFN rank runs the runtime's own server loop on an echo; with ``rec``, both ranks record every
    exchange as the runtime does with metrics on (the attention rank through ``RunnerConnector``).
    """
    from afd_sdk.runtime.attention_runner import RunnerConnector, announce_step
    from afd_sdk.wire import ControlPayload, TransferMetadata

    if role == "ffn":
        _serve_block(conn, count, rec)
        return
    data = conn if rec is None else RunnerConnector(conn, None, None, rec)
    tokens = payload.shape[0]
    routing: dict[str, torch.Tensor] = {}
    if conn.capabilities.async_dispatch:  # top-1 to the single expert, echoed, combined with weight 1
        routing = _top1_routing(tokens)
    else:
        announce_step(conn, ControlPayload(step, ((tokens,),), tokens, count))
    for layer in range(count):
        md = TransferMetadata(0 if routing else layer, 0, (tokens,))
        t0 = time.perf_counter_ns()
        data.send_attn_output(payload, md, **routing)
        data.recv_ffn_output(payload, 0)
        if layer >= 2:
            out.append(time.perf_counter_ns() - t0)
    if rec is not None:
        rec.observe_step(tokens)


def _profile_size(
    conn: Any, role: str, raws: dict[str, Any], payload: torch.Tensor, step: int, count: int
) -> dict[str, Any]:
    """``--profile``: one block per raw baseline and one through the connector, each call timed (see roundtrip_profile).

    Both ranks run 2 warm-up round trips, ``count`` timed ones and ``count`` under cProfile per transport. The
    connector runs step ``step`` (warm-up and timed) and step ``step + 1`` (profiled), both of layers seen before.
    """
    from afd_sdk.runtime.attention_runner import announce_step
    from afd_sdk.wire import ControlPayload, TransferMetadata

    out: dict[str, Any] = {}
    size = payload.numel() * payload.element_size()
    for name, raw in raws.items():
        if role == "attention":
            rt = raw.attention_round_trip(payload.view(-1))
            rt(), rt()
            out[name] = profile_attention(lambda _i, rt=rt: rt(), None, count)
        else:
            raw.ffn_echo(2, size)
            out[name] = profile_ffn(None, None, lambda n, raw=raw: raw.ffn_echo(n, size), count)
    routed = conn.capabilities.async_dispatch
    between: Callable[[], None] | None = None
    if role == "attention":
        tokens = payload.shape[0]
        routing: dict[str, torch.Tensor] = {}
        if routed:
            routing = _top1_routing(tokens)
        else:
            announce_step(conn, ControlPayload(step, ((tokens,),), tokens, 2 + count))
            between = lambda: announce_step(conn, ControlPayload(step + 1, ((tokens,),), tokens, count))  # noqa: E731

        def send(i: int) -> None:
            conn.send_attn_output(payload, TransferMetadata(0 if routed else i + 2, 0, (tokens,)), **routing)

        def recv() -> None:
            conn.recv_ffn_output(payload, 0)

        for i in (-2, -1):
            send(i), recv()
        out["connector"] = profile_attention(send, recv, count, between)
        return out
    if routed:
        recv_item: Callable[[], Any] = lambda: conn.recv_ffn_work_item(0)  # noqa: E731
        send_back: Callable[[Any], None] = lambda item: conn.send_ffn_work_item_output(item, item.hidden_states)  # noqa: E731
    else:
        cp = conn.require_control_plane()
        cp.apply(cp.recv())
        between = lambda: cp.apply(cp.recv())  # noqa: E731
        recv_item = lambda: conn.recv_attn_output(0)  # noqa: E731
        send_back = lambda a: conn.send_ffn_output(a.hidden_states, a.metadata)  # noqa: E731
    for _ in range(2):
        send_back(recv_item())
    out["connector"] = profile_ffn(recv_item, send_back, None, count, between)
    return out


def _top1_routing(tokens: int) -> dict[str, torch.Tensor]:
    """Routing for a routed-dispatch connector: every token to the single expert, with weight 1."""
    return {"topk_ids": torch.zeros(tokens, 1, dtype=torch.long), "topk_weights": torch.ones(tokens, 1)}


def _echo(layer_idx: int, hidden_states: torch.Tensor, extras: Any) -> torch.Tensor:
    return hidden_states


def _serve_block(conn: Any, count: int, rec: AFDMetrics | None) -> None:
    """The FFN rank's side of one block: ``FFNServer`` (one step of ``count`` layers) or ``ExpertServer``."""
    from afd_sdk.runtime.serve import server_for

    server_for(conn, _echo, max_steps=count if conn.capabilities.async_dispatch else 1, metrics=rec).serve()


def recording_cost_ns(role: str, n: int = 200_000) -> float:
    """What recording adds to one exchange, in ns: the runtime's metered path minus the bare one, same calls.

    Attention: ``RunnerConnector`` with metrics around a do-nothing connector, against that connector called
    directly. FFN: the clock reads, ``payload_bytes`` and the two ``observe_*`` calls ``FFNServer`` adds.
    """
    from afd_sdk.metrics import MetricsHub
    from afd_sdk.runtime.attention_runner import RunnerConnector
    from afd_sdk.runtime.stats import payload_bytes
    from afd_sdk.wire import TransferMetadata

    rec = MetricsHub().recorder(connector="bench", role=role, rank=0, port=0, num_stages=1)
    x = torch.empty(4, HIDDEN)
    md = TransferMetadata(0, 0, (4,))

    class Null:
        def send_attn_output(self, hidden_states: Any, metadata: Any, *, extras: Any = None, **routing: Any) -> None:
            pass

        def recv_ffn_output(self, ref_tensor: Any, stage_idx: int = 0) -> Any:
            return ref_tensor

    def loop(fn: Callable[[], None]) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        return (time.perf_counter_ns() - t0) / n

    if role == "attention":
        bare, metered = Null(), RunnerConnector(Null(), None, None, rec)  # type: ignore[arg-type]

        def plain() -> None:
            bare.send_attn_output(x, md)
            bare.recv_ffn_output(x, 0)

        def recorded() -> None:
            metered.send_attn_output(x, md)
            metered.recv_ffn_output(x, 0)
    else:
        clock = time.perf_counter

        def plain() -> None:
            pass

        def recorded() -> None:
            r0 = clock()
            c1 = clock()
            rec.observe_compute(c1 - r0, 4)
            rec.observe_exchange(0, clock() - r0, x.nbytes, payload_bytes(x, None))

    loop(plain), loop(recorded)  # warm
    return min(loop(recorded) - loop(plain) for _ in range(3))


def _idle_probe(conn: Any, role: str, step: int, idle_s: float) -> float | None:
    """One 1-token round trip after ``idle_s`` of silence; the FFN rank returns its CPU % over the wait."""
    from afd_sdk.runtime.attention_runner import announce_step
    from afd_sdk.wire import ControlPayload, TransferMetadata

    routed = conn.capabilities.async_dispatch
    if role == "attention":
        one = torch.randn(1, HIDDEN)
        announce_step(conn, ControlPayload(step, ((1,),), 1, 1))
        time.sleep(idle_s)
        md = TransferMetadata(0, 0, (1,))
        if routed:
            conn.send_attn_output(one, md, **_top1_routing(1))
        else:
            conn.send_attn_output(one, md)
        conn.recv_ffn_output(one, 0)
        return None
    if not routed:
        cp = conn.require_control_plane()
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


def check_baselines(connector_cls: Any, baselines: tuple[str, ...] | None) -> tuple[str, ...]:
    """The baselines to run for ``connector_cls`` (its defaults for ``None``); unknown names are a config error."""
    from afd_sdk.errors import AFDConfigError

    declared = tuple(connector_cls.raw_baselines)
    if baselines is None:  # what the connector declares, in its order; raw ZMQ and Gloo when it declares none
        return declared or ("zmq", "gloo")
    known = (*RAW_BASELINES, *(b for b in declared if b not in RAW_BASELINES))
    unknown = [b for b in baselines if b not in known]
    if unknown:
        raise AFDConfigError(
            f"--raw {','.join(unknown)} is not a baseline of {connector_cls.name}; expected some of {', '.join(known)}",
            key="raw",
            value=",".join(unknown),
        )
    return baselines


def run_benchmark(
    connector: str,
    sizes: list[int],
    *,
    iters: int = 200,
    baselines: tuple[str, ...] | None = None,
    extra_config: dict[str, Any] | None = None,
    timeout_s: float = 30.0,
    metrics: bool = False,
    profile: bool = False,
) -> dict[str, Any]:
    """Run the two-process benchmark and return ``{"connector", "baselines", "rows"}``.

    With ``profile``, every row gets ``profile[transport]["attention" | "ffn"]``: the round trip
    broken into its parts (:mod:`afd_sdk.bench.roundtrip_profile`), and the result the machine's
    ``wake_penalty`` per rank.

    With ``metrics``, every size also runs the connector with metrics recording on (column
    ``connector+metrics``, ``metrics_delta_us`` per row) and each rank measures the recording's own
    cost per exchange (``recording_ns``).
    """
    from afd_sdk.errors import AFDError
    from afd_sdk.plugins import get_plugin_manager
    from afd_sdk.runtime.world import FAIL_FAST_S, free_port_block, run_world

    cls = get_plugin_manager().connector_class(connector)
    baselines = check_baselines(cls, baselines)
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
        "metrics": metrics,
        "profile": profile,
    }
    if cls.capabilities.async_dispatch:
        spec["afd"]["compute_gate_on_attention"] = True
        spec["moe"] = {"num_experts": 1, "top_k": 1, "layers": [0]}
    world = run_world(spec, module="afd_sdk.bench.connector_bench", timeout_s=600, fail_fast_s=FAIL_FAST_S)
    (attn,) = world.by_role("attention")
    (ffn,) = world.by_role("ffn")
    if not all(r.ok for r in world.ranks):
        raise AFDError(f"benchmark failed:\n{world.describe()}")
    for row in attn.result["rows"]:
        if profile:
            ffn_prof = ffn.result["profile"][str(row["size"])]
            row["profile"] = {name: {"attention": a, "ffn": ffn_prof[name]} for name, a in row["profile"].items()}
        conn = row["connector"]["median_us"]
        for b in baselines:
            row[f"ratio_{b}"] = conn / row[b]["median_us"]
            row[f"delta_{b}_us"] = conn - row[b]["median_us"]
        if metrics:
            row["metrics_delta_us"] = row[METERED]["median_us"] - conn
    out = {
        "connector": cls.name,
        "wire": attn.result.get("wire"),
        "baselines": list(baselines),
        "hidden": HIDDEN,
        "dtype": "float32",
        "rows": attn.result["rows"],
        "idle_s": IDLE_S,
        "ffn_idle_cpu_pct": ffn.result.get("idle_cpu_pct"),
    }
    if profile:
        out["wake_penalty"] = {"attention": attn.result["wake_penalty"], "ffn": ffn.result["wake_penalty"]}
    if metrics:
        out["recording_ns"] = {"attention": attn.result["recording_ns"], "ffn": ffn.result["recording_ns"]}
        out["recorded_exchanges"] = {
            "attention": attn.result["recorded_exchanges"],
            "ffn": ffn.result["recorded_exchanges"],
        }
    return out


def main(argv: list[str]) -> int:
    from afd_sdk.runtime.world import worker_main

    return worker_main(_worker, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
