"""Prometheus metrics of the AFD data path: cheap recorders on the hot path, families built at scrape time.

The runtime records into :class:`AFDMetrics` (one per connector, that is one
per AFD world a process serves) with plain integer and float arithmetic: no
lock, no label lookup, no string formatting per exchange. ``prometheus_client``
is touched only when something scrapes: :func:`collector` turns every
recorder of a :class:`MetricsHub` into metric families. To add the AFD
metrics to a registry that already exports (vLLM's ``/metrics`` serves
``prometheus_client.REGISTRY`` of its API-server process)::

    prometheus_client.REGISTRY.register(afd_sdk.metrics.collector())

in the process that runs the AFD role. ``afd ffn serve --metrics-port`` and
``afd attention generate --metrics-port`` serve their own endpoint instead
(:mod:`afd_sdk.runtime.ops_server`). A scrape that runs while an exchange is
being recorded may see that exchange in one family and not yet in another;
each histogram's count is its buckets' sum, so every family is consistent in itself.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from afd_sdk.errors import PeerLostError

if TYPE_CHECKING:
    from afd_sdk.connector import ConnectorBase, LostPeer

__all__ = [
    "EXCHANGE_BUCKETS_S",
    "PEER_STATES",
    "TOKEN_BUCKETS",
    "AFDMetrics",
    "FailoverStats",
    "MetricsHub",
    "collector",
    "default_hub",
    "registry",
    "tracking",
]

#: upper bounds (seconds) of the exchange and FFN compute histograms: 10 µs .. 10 s
EXCHANGE_BUCKETS_S: tuple[float, ...] = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
#: upper bounds of the tokens-per-step and tokens-per-fan-in histograms: powers of two up to 64 Ki
TOKEN_BUCKETS: tuple[float, ...] = tuple(float(2**i) for i in range(17))

#: the states of a world's peers, in the order a world goes through them
PEER_STATES = ("connecting", "connected", "closed", "lost")
PeerState = Literal["connecting", "connected", "closed", "lost"]


class _Histogram:
    """Bucket counts and a sum; ``observe`` is a bisect and two additions."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), total))
        return out


class FailoverStats:
    """An attention rank's FFN failovers (``afd.ffn_replicas`` > 1): written by its failover, read by scrapes.

    ``replica`` is the replica in use, ``failovers`` how many times it changed
    (the membership epoch of this rank), ``stall`` the seconds from a loss to
    the next completed layer on the new replica. CAM with redundant experts:
    ``failovers`` counts the FFN ranks routed around, ``rejoins`` those routed
    to again after they rejoined (its epoch is the sum). ``live``: the replicas
    of the FFN rank that answer this rank's probe, the one in use included
    (:mod:`afd_sdk.runtime.replica_beacon`); ``None`` while not known (CAM, or
    before the probe's first count).
    """

    __slots__ = ("failovers", "live", "rejoins", "replica", "replicas", "stall")

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self.replica = 0
        self.failovers = 0
        self.rejoins = 0
        self.live: int | None = None
        self.stall = _Histogram(EXCHANGE_BUCKETS_S)

    def observe_failover(self, replica: int) -> None:
        self.replica = replica
        self.failovers += 1

    def observe_rejoin(self) -> None:
        self.rejoins += 1

    def observe_stall(self, seconds: float) -> None:
        self.stall.observe(seconds)


class AFDMetrics:
    """What one connector's data path did in this process, recorded by the runtime loops.

    Created by :meth:`MetricsHub.recorder`. The runtime calls the
    ``observe_*`` methods once per exchange or step from the thread that
    runs the exchange (stage threads of one attention rank take turns under
    the runner's baton), and :meth:`set_peer_state` / :meth:`count_error` at
    lifecycle points. Values only grow except the peer state.
    """

    __slots__ = (
        "_experts",
        "bytes_received",
        "bytes_sent",
        "compute",
        "connector",
        "errors",
        "exchange",
        "failover",
        "ffn_batch",
        "liveness",
        "peer_state",
        "port",
        "rank",
        "role",
        "step_tokens",
        "steps",
    )

    def __init__(self, *, connector: str, role: str, rank: int, port: int, num_stages: int) -> None:
        self.connector = connector
        self.role = role
        self.rank = rank
        self.port = port
        #: per stage: seconds of one layer's exchange (attention: send to result; FFN: recv call to reply sent)
        self.exchange = [_Histogram(EXCHANGE_BUCKETS_S) for _ in range(num_stages)]
        self.compute = _Histogram(EXCHANGE_BUCKETS_S)
        self.step_tokens = _Histogram(TOKEN_BUCKETS)
        self.ffn_batch = _Histogram(TOKEN_BUCKETS)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.steps = 0
        self.errors: dict[str, int] = {}
        self.peer_state: PeerState = "connecting"
        #: who says, from any thread, which peers are gone while the world is idle (``for_connector`` sets it to
        #: the connector's ``lost_peers``); ``None``: only the runtime's state counts
        self.liveness: Callable[[], tuple[LostPeer, ...]] | None = None
        #: the failovers of an attention rank with FFN replicas (``for_connector`` finds them); ``None``: none
        self.failover: FailoverStats | None = None
        self._experts: dict[int, int] = {}

    # --- hot path: once per exchange --------------------------------------------------

    def observe_exchange(self, stage: int, seconds: float, sent: int, received: int) -> None:
        """One layer's exchange on ``stage``: its duration and the payload bytes each way."""
        self.exchange[stage].observe(seconds)
        self.bytes_sent += sent
        self.bytes_received += received

    def observe_compute(self, seconds: float, tokens: int) -> None:
        """FFN side: one layer's FFN compute on ``tokens`` fanned-in tokens."""
        self.compute.observe(seconds)
        self.ffn_batch.observe(tokens)

    def observe_expert_rows(self, first_expert: int, rows: Sequence[int]) -> None:
        """Routed dispatch, FFN side: ``rows[i]`` rows went to expert ``first_expert + i`` in one work item."""
        experts = self._experts
        for i, n in enumerate(rows):
            if n:
                experts[first_expert + i] = experts.get(first_expert + i, 0) + n

    # --- once per step / lifecycle ------------------------------------------------------

    def observe_step(self, tokens: int) -> None:
        """One model step of ``tokens`` tokens (all stages and, on the FFN side, all attention peers)."""
        self.steps += 1
        self.step_tokens.observe(tokens)

    def set_peer_state(self, state: PeerState) -> None:
        """The world's peers: ``connecting`` until the handshake, then ``connected``, ``closed`` or ``lost``."""
        self.peer_state = state

    def lost_peers(self) -> tuple[LostPeer, ...]:
        """The peers :attr:`liveness` reports gone right now (``()`` without a liveness source)."""
        return () if self.liveness is None else self.liveness()

    def current_state(self) -> tuple[PeerState, tuple[LostPeer, ...]]:
        """The peer state as a probe should see it: ``lost`` also when a connected world's peer dropped while idle."""
        state = self.peer_state
        if state != "connected":
            return state, ()
        lost = self.lost_peers()
        return ("lost" if lost else state), lost

    def count_error(self, exc: BaseException) -> None:
        """An error that ended or interrupted this world, counted by its class name."""
        name = type(exc).__name__
        self.errors[name] = self.errors.get(name, 0) + 1

    def record_failure(self, exc: BaseException) -> None:
        """The world ended with ``exc``: count it; peers ``lost`` (a ``PeerLostError``) or ``closed`` (other errors).

        A world ends once: the same failure seen again by an outer caller, after the peers were already
        ``lost`` or ``closed``, is not counted twice.
        """
        if self.peer_state in ("lost", "closed"):
            return
        self.count_error(exc)
        self.set_peer_state("lost" if isinstance(exc, PeerLostError) else "closed")

    @property
    def exchanges(self) -> int:
        """Exchanges recorded so far, over every stage."""
        return sum(sum(h.counts) for h in self.exchange)

    @property
    def expert_rows(self) -> dict[int, int]:
        """Rows dispatched to each expert so far (routed dispatch, FFN side)."""
        return dict(self._experts)


class MetricsHub:
    """The recorders of one process; what a scrape and the readiness check read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recorders: list[AFDMetrics] = []

    def recorder(self, *, connector: str, role: str, rank: int, port: int, num_stages: int) -> AFDMetrics:
        """A new recorder for one connector (one world), registered with this hub."""
        rec = AFDMetrics(connector=connector, role=role, rank=rank, port=port, num_stages=num_stages)
        with self._lock:
            self._recorders.append(rec)
        return rec

    def for_connector(self, connector: ConnectorBase) -> AFDMetrics:
        """A new recorder labelled with ``connector``'s name, role, rank and world port (``afd.port``)."""
        cfg = connector.config
        rec = self.recorder(
            connector=connector.display_name,
            role=cfg.role,
            rank=connector.context.role_rank,
            port=cfg.port,
            num_stages=cfg.num_stages,
        )

        rec.liveness = connector.lost_peers
        rec.failover = getattr(connector, "failover_stats", None)  # a FailoverConnector's (afd.ffn_replicas > 1)
        return rec

    def recorders(self) -> list[AFDMetrics]:
        with self._lock:
            return list(self._recorders)

    def ready(self) -> bool:
        """True when there is a world and every world's peers are connected, none of them lost while idle."""
        recs = self.recorders()
        return bool(recs) and all(r.current_state()[0] == "connected" for r in recs)


_DEFAULT = MetricsHub()


def _no_op() -> None:
    pass


@contextlib.contextmanager
def tracking(rec: AFDMetrics | None) -> Iterator[Callable[[], None]]:
    """One world's peer state around its run: ``with tracking(rec) as connected:`` wraps ``init()`` and the run.

    Call ``connected()`` once the handshake is done. Leaving the block
    normally marks the peers ``closed``; an exception is recorded
    (:meth:`AFDMetrics.record_failure`) and propagates. With ``rec=None``
    nothing is recorded, so callers need no branch of their own.
    """
    if rec is None:
        yield _no_op
        return
    try:
        yield lambda: rec.set_peer_state("connected")
    except Exception as exc:
        rec.record_failure(exc)
        raise
    rec.set_peer_state("closed")


def default_hub() -> MetricsHub:
    """The process-wide hub that :func:`collector` reads when given none."""
    return _DEFAULT


def _families(hub: MetricsHub) -> Iterator[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    base = ["connector", "role", "rank", "port"]
    exchange = HistogramMetricFamily(
        "afd_exchange_seconds",
        "One layer's exchange: attention from send to the FFN result, FFN from receive call to reply sent",
        labels=[*base, "stage"],
    )
    compute = HistogramMetricFamily(
        "afd_ffn_compute_seconds", "FFN compute of one layer on the fanned-in tokens", labels=base
    )
    batch = HistogramMetricFamily(
        "afd_ffn_batch_tokens", "Tokens per FFN exchange (all attention peers fanned in)", labels=base
    )
    step_tokens = HistogramMetricFamily("afd_step_tokens", "Tokens per model step", labels=base)
    sent = CounterMetricFamily("afd_sent_bytes", "Payload bytes sent (hidden states, extras, routing)", labels=base)
    received = CounterMetricFamily("afd_received_bytes", "Payload bytes received", labels=base)
    steps = CounterMetricFamily("afd_steps", "Model steps served or run", labels=base)
    errors = CounterMetricFamily(
        "afd_errors", "Errors that ended or interrupted a world, by type", labels=[*base, "type"]
    )
    peers = GaugeMetricFamily("afd_peer_state", "1 for the current state of the world's peers", labels=[*base, "state"])
    experts = CounterMetricFamily(
        "afd_expert_rows", "Rows dispatched to each routed expert (async dispatch)", labels=[*base, "expert"]
    )
    failovers = CounterMetricFamily(
        "afd_failovers", "Times this attention rank moved to another FFN replica (its membership epoch)", labels=base
    )
    rejoins = CounterMetricFamily(
        "afd_ffn_rejoins", "FFN ranks this attention rank routes to again after they rejoined (CAM)", labels=base
    )
    replica = GaugeMetricFamily("afd_ffn_replica", "The FFN replica this attention rank uses", labels=base)
    replicas = GaugeMetricFamily("afd_ffn_replicas", "FFN replicas configured per FFN rank", labels=base)
    live = GaugeMetricFamily(
        "afd_ffn_replicas_live", "Replicas of this attention rank's FFN rank that answer its probe", labels=base
    )
    stall = HistogramMetricFamily(
        "afd_failover_stall_seconds", "From an FFN replica's loss to the next completed layer on another", labels=base
    )
    for r in hub.recorders():
        lab = [r.connector, r.role, str(r.rank), str(r.port)]
        for stage, h in enumerate(r.exchange):
            exchange.add_metric([*lab, str(stage)], h.cumulative(), h.sum)
        if r.role == "ffn":
            compute.add_metric(lab, r.compute.cumulative(), r.compute.sum)
            batch.add_metric(lab, r.ffn_batch.cumulative(), r.ffn_batch.sum)
        step_tokens.add_metric(lab, r.step_tokens.cumulative(), r.step_tokens.sum)
        sent.add_metric(lab, r.bytes_sent)
        received.add_metric(lab, r.bytes_received)
        steps.add_metric(lab, r.steps)
        for name, n in sorted(r.errors.items()):
            errors.add_metric([*lab, name], n)
        current = r.current_state()[0]  # a peer that dropped while the world idles shows as lost
        for state in PEER_STATES:
            peers.add_metric([*lab, state], 1.0 if current == state else 0.0)
        for expert, n in sorted(r.expert_rows.items()):
            experts.add_metric([*lab, str(expert)], n)
        f = r.failover
        if f is not None:
            failovers.add_metric(lab, f.failovers)
            rejoins.add_metric(lab, f.rejoins)
            replica.add_metric(lab, f.replica)
            replicas.add_metric(lab, f.replicas)
            if f.live is not None:
                live.add_metric(lab, f.live)
            stall.add_metric(lab, f.stall.cumulative(), f.stall.sum)
    yield from (exchange, compute, batch, step_tokens, sent, received, steps, errors, peers, experts)
    yield from (failovers, rejoins, replica, replicas, live, stall)


class _Collector:
    """A ``prometheus_client`` collector over one hub (``collect`` is all a registry asks of it)."""

    def __init__(self, hub: MetricsHub) -> None:
        self.hub = hub

    def collect(self) -> Iterator[Any]:
        return _families(self.hub)


def collector(hub: MetricsHub | None = None) -> Any:
    """A collector of ``hub``'s metrics (default: :func:`default_hub`) to register with any registry."""
    return _Collector(hub or _DEFAULT)


def registry(hub: MetricsHub | None = None, *, process: bool = True) -> Any:
    """A fresh ``CollectorRegistry`` with ``hub``'s metrics and, with ``process``, the process's RSS, fds and CPU."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector(hub))
    if process:
        ProcessCollector(registry=reg)
    return reg
