"""How many replicas of its FFN rank an attention rank could still fail over to: a beacon per replica, a probe per
attention rank.

With ``afd.ffn_replicas`` > 1 an attention rank talks to one replica of its FFN rank at a time; the standbys do
not hear from it until a failover, so without a probe it cannot tell a dead standby from a live one. Each
``afd ffn serve --replica K`` runs a :class:`ReplicaBeacon`: a ROUTER socket on a port of its own that echoes
every 8-byte ping, on a thread of its own (a frozen or killed process answers nothing). Each attention rank's
:class:`~afd_sdk.runtime.failover.FailoverConnector` runs a :class:`ReplicaProbe` that pings every replica of its
FFN rank once per heartbeat interval (the control plane's, ``timeout_s / 6`` within 50 ms..2 s) and counts a
replica live while its last answer is at most three intervals old: the ``afd_ffn_replicas_live`` gauge.

The probe does not ping the replicas' control sockets: an FFN rank counts every connection to its control socket
as an attention peer's (its liveness comes from connection events, and libzmq's ``ZMQ_ROUTER_NOTIFY``, which would
name the connection, is a draft API that pyzmq's bundled libzmq 4.3.5 refuses), so a probe's connection there
would look like a lost peer when it closed. The beacon's port is the first after the replica's world, per FFN
rank: :func:`beacon_port`. Nothing is pickled: a ping is a sequence number, the answer is the same bytes.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import zmq

from afd_sdk.config import AFDConfig
from afd_sdk.control.endpoint import bindable, terminate_context
from afd_sdk.errors import ConnectorError

logger = logging.getLogger(__name__)

__all__ = ["ReplicaBeacon", "ReplicaProbe", "beacon_address", "beacon_port"]

_PING = struct.Struct("<Q")
#: intervals without an answer after which a replica no longer counts as live (the control plane's heartbeat limit)
MISSED_LIMIT = 3
#: a probe's ping interval until its first count
_STARTUP_S = 0.02
#: the longest a beacon's or probe's thread blocks before it looks at its stop flag
_POLL_MS = 200


def beacon_port(world: AFDConfig, ffn_rank: int) -> int:
    """The beacon port of FFN rank ``ffn_rank`` in the replica world ``world`` (its ``afd.port`` already shifted by
    the replica): the first port after the world's own, ``port + F × (1 + num_stages) + ffn_rank``, which
    ``afd.replica_port_stride`` (at least ``F × (2 + num_stages)`` with replicas) keeps clear of the next
    replica's."""
    return world.port + world.num_ffn_ranks * (1 + world.num_stages) + ffn_rank


def beacon_address(world: AFDConfig, ffn_rank: int) -> str:
    """``tcp://<the FFN rank's host in world>:<beacon_port>``."""
    return f"tcp://{world.ffn_host(ffn_rank)}:{beacon_port(world, ffn_rank)}"


class ReplicaBeacon:
    """FFN side: one socket per world this replica serves (``addresses``: world port -> beacon address), answering
    pings from :meth:`start` on, until :meth:`retire` (that world ended) or :meth:`close`.

    ``afd ffn serve --replica K`` binds it before loading the weights (a port in use fails then, with
    ``ConnectorError`` naming the address; a host name waits ``resolve_wait_s`` for its DNS record, as the control
    plane's does), starts it once they are loaded (until then pings go unanswered: the replica could not take a
    failover yet), retires a world when it ends (its attention ranks can no longer fail over to it) and closes it
    at exit. :meth:`start`, :meth:`retire` and :meth:`close` may be called from any thread.
    """

    def __init__(self, addresses: Mapping[int, str], *, resolve_wait_s: float = 0.0) -> None:
        self.addresses = dict(addresses)
        self._ctx = zmq.Context(io_threads=1)
        self._socks: dict[int, zmq.Socket] = {}
        self._stop = threading.Event()
        self._retired: set[int] = set()  # written by retire(), applied by the beacon's thread
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        try:
            for world, address in self.addresses.items():
                sock = self._socks[world] = self._ctx.socket(zmq.ROUTER)
                sock.setsockopt(zmq.LINGER, 0)
                try:
                    sock.bind(bindable(address, resolve_wait_s))
                except zmq.ZMQError as exc:
                    raise ConnectorError(
                        f"cannot bind the FFN replica's beacon at {address}: {exc}; expected that port free (the "
                        "first after the replica's world: afd.port + K * afd.replica_port_stride + num_ffn_ranks * "
                        "(1 + num_stages) + ffn rank)"
                    ) from exc
        except BaseException:
            _shut_down(self._stop, None, list(self._socks.values()), self._ctx, self._what())
            raise

    def start(self) -> None:
        """Answer pings from now on (on a thread of the beacon's own)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="afd-replica-beacon", daemon=True)
            self._thread.start()

    def retire(self, world: int) -> None:
        """Stop answering for the world at port ``world`` (it ended); the beacon's thread closes that socket."""
        with self._lock:
            self._retired.add(world)

    def _run(self) -> None:
        poller = zmq.Poller()
        live = dict(self._socks)
        for sock in live.values():
            poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                with self._lock:
                    gone = [w for w in self._retired if w in live]
                for world in gone:
                    sock = live.pop(world)
                    poller.unregister(sock)
                    sock.close(linger=0)  # pings to it now go unanswered: that world's replica is gone
                for sock, _ in poller.poll(_POLL_MS):
                    self._answer(sock)
        except zmq.ZMQError as exc:  # the context went away under us (process exit): nothing left to answer
            logger.debug("%s ended: %s", self._what(), exc)

    @staticmethod
    def _answer(sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) == 2 and len(frames[1]) == _PING.size:  # anything else is not a ping: ignored
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK)
                except zmq.ZMQError as exc:  # the prober left meanwhile: its next ping gets the answer
                    logger.debug("replica beacon: answer not sent: %s", exc)

    def close(self) -> None:
        _shut_down(self._stop, self._thread, list(self._socks.values()), self._ctx, self._what())

    def _what(self) -> str:
        return f"the replica beacon on {', '.join(self.addresses.values())}"


class ReplicaProbe:
    """Attention side: ping each of ``addresses`` (one per replica) every ``period_s``; :attr:`live` counts those
    whose last answer is at most :data:`MISSED_LIMIT` periods old.

    ``on_change(live)`` runs on the probe's thread whenever the count changes: the first time once every replica
    answered or :data:`MISSED_LIMIT` periods passed, and with ``None`` if the probe fails (the count is no longer
    known). Built by :class:`~afd_sdk.runtime.failover.FailoverConnector` when it opens, closed when it is
    released.
    """

    def __init__(self, addresses: Sequence[str], period_s: float, on_change: Callable[[int | None], None]) -> None:
        self.addresses = tuple(addresses)
        self.period_s = period_s
        self.on_change = on_change
        #: replicas answering now; ``None`` until the first count
        self.live: int | None = None
        self._ctx = zmq.Context(io_threads=1)
        self._socks: list[zmq.Socket] = []
        self._stop = threading.Event()
        try:
            for address in self.addresses:
                sock = self._ctx.socket(zmq.DEALER)
                self._socks.append(sock)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.IMMEDIATE, 1)  # no ping queued for a replica not connected: it is not live
                sock.setsockopt(zmq.SNDHWM, 4)  # a frozen replica's connection holds a few pings, not a backlog
                # a half-open connection (the replica's host crashed, a partition) is dropped and dialled again
                # within three intervals, not after TCP's retransmission backoff
                sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(period_s * 1000)))
                sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(MISSED_LIMIT * period_s * 1000)))
                sock.setsockopt(zmq.RECONNECT_IVL, 100)
                sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(100, int(period_s * 1000)))
                sock.connect(address)
        except zmq.ZMQError as exc:
            _shut_down(self._stop, None, self._socks, self._ctx, self._what())
            raise ConnectorError(f"cannot connect the replica probe to {address}: {exc}") from exc
        self._thread = threading.Thread(target=self._run, name="afd-replica-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        socks = self._socks
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        last_answer: list[float | None] = [None] * len(socks)
        seq = 0
        start = next_ping = time.monotonic()
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_ping:
                    seq += 1
                    ping = _PING.pack(seq)
                    for sock in socks:
                        try:
                            sock.send(ping, zmq.NOBLOCK)
                        except zmq.Again:  # not connected (IMMEDIATE) or its few pings unanswered: not live
                            pass
                    # until the first count, ping at the start-up pace: the connections come up within
                    # milliseconds, and the first ping (IMMEDIATE) went nowhere
                    next_ping = now + (self.period_s if self.live is not None else min(self.period_s, _STARTUP_S))
                wait_ms = max(1, min(_POLL_MS, int((next_ping - now) * 1000)))
                for sock, _ in poller.poll(wait_ms):
                    i = socks.index(sock)
                    while True:
                        try:
                            sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        last_answer[i] = time.monotonic()
                now = time.monotonic()
                limit = MISSED_LIMIT * self.period_s
                live = sum(1 for t in last_answer if t is not None and now - t <= limit)
                if self.live is None and live < len(socks) and now - start < limit:
                    continue  # the first count: every replica answered, or had as long to as it has later
                if live != self.live:
                    self.live = live
                    self.on_change(live)
        except zmq.ZMQError as exc:  # the context went away under us (process exit)
            logger.debug("%s ended: %s", self._what(), exc)
        except Exception:  # the count would freeze at a stale value: say so, and stop claiming one
            logger.exception("%s failed; the live-replica count is unknown", self._what())
            self.live = None
            self.on_change(None)

    def close(self) -> None:
        _shut_down(self._stop, self._thread, self._socks, self._ctx, self._what())

    def _what(self) -> str:
        return f"the replica probe of {', '.join(self.addresses)}"


def _shut_down(
    stop: threading.Event, thread: threading.Thread | None, socks: Sequence[zmq.Socket], ctx: zmq.Context, what: str
) -> None:
    """Stop a beacon's or probe's ``thread`` (``None``: it never started), then close its sockets and context.

    The thread owns the sockets while it runs and looks at ``stop`` every :data:`_POLL_MS`; one that does not end
    in five of those keeps them (a warning says so), as closing them under it would be unsafe.
    """
    stop.set()
    if thread is not None:
        thread.join(timeout=5 * _POLL_MS / 1000)
        if thread.is_alive():
            logger.warning("%s did not stop within %d ms", what, 5 * _POLL_MS)
            return
    for sock in socks:
        if not sock.closed:  # a beacon's thread closes the sockets of the worlds it retired
            sock.close(linger=0)
    terminate_context(ctx, what, linger_s=0.0)
