"""A ZMQ socket with liveness: ZMTP heartbeats plus a monitor for disconnects.

libzmq pings the peer every ``heartbeat_ivl`` and drops the connection when no
pong arrives within ``heartbeat_timeout``; the drop (or a peer's exit, which
closes its TCP connection) shows up on the monitor socket as DISCONNECTED.
:meth:`ZmqEndpoint.wait` polls data and monitor together, so a blocked call on
the survivor turns into ``PeerLostError`` within ``timeout_s``.

A *watched* endpoint (``watch=True``, the control planes' sockets) reads its
monitor on a thread of its own instead, so the loss of an idle peer is known
within the heartbeat timeout with no call in progress: :meth:`ZmqEndpoint.lost_for`
answers from any thread (the ops endpoint's ``/readyz``).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Literal

import zmq
from zmq.utils.monitor import parse_monitor_message

from afd_sdk.control.process_groups import addrinfo
from afd_sdk.errors import AFDConfigError, ConnectorError, DrainedError, PeerLostError

logger = logging.getLogger(__name__)

__all__ = ["ZmqEndpoint", "endpoint_address", "heartbeat_interval_s", "terminate_context"]

# MONITOR_STOPPED wakes a watching thread at close (disable_monitor() sends it only when it is in the mask)
_MONITORED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED
#: the longest a watching thread blocks before it looks at its stop flag (close() normally wakes it at once)
_WATCH_POLL_MS = 500
#: what :func:`terminate_context` allows beyond the sockets' linger (libzmq's I/O thread ending its pipes)
TERM_GRACE_S = 5.0


def terminate_context(ctx: zmq.Context, what: str, linger_s: float = 1.0) -> None:
    """``ctx.term()`` with a deadline: ``linger_s`` (the longest linger of its sockets) plus :data:`TERM_GRACE_S`.

    Called by a connector's or control plane's close once every socket of ``ctx`` is closed; ``term()`` then
    waits for their pending messages (up to their linger) and for libzmq's I/O thread, and returns. It has no
    deadline of its own: a socket left open, or libzmq's own shutdown stuck, would hold the caller forever (once
    in CI, an attention rank of a 3A2F ipc world hung there after its goodbye). So ``term()`` runs on a thread
    of its own. Past the deadline, sockets of ``ctx`` still open are a bug of the caller: ``ConnectorError``
    naming them. With none open the shutdown is libzmq's: a warning, and the context is left to the process's
    exit (its thread is a daemon).
    """
    done = threading.Event()
    failure: list[BaseException] = []

    def term() -> None:
        try:
            ctx.term()
        except BaseException as exc:  # handed to the caller below
            failure.append(exc)
        finally:
            done.set()

    within_s = linger_s + TERM_GRACE_S
    threading.Thread(target=term, name=f"afd-zmq-term {what}", daemon=True).start()
    if done.wait(within_s):
        if failure:
            raise failure[0]
        return
    open_sockets = [s for s in list(getattr(ctx, "_sockets", None) or ()) if not s.closed]
    if open_sockets:
        kinds = ", ".join(sorted(zmq.SocketType(s.type).name for s in open_sockets))
        raise ConnectorError(
            f"the ZMQ context of {what} did not terminate within {within_s:g} s: {len(open_sockets)} of its "
            f"sockets are still open ({kinds}); expected every socket closed before the context"
        )
    logger.warning(
        "the ZMQ context of %s did not terminate within %g s with all of its sockets closed (libzmq's shutdown); "
        "left to the process's exit",
        what,
        within_s,
    )


def heartbeat_interval_s(timeout_s: float) -> float:
    """The liveness interval for an exchange deadline of ``timeout_s``: ``timeout_s / 6`` within 50 ms..2 s.

    ZMTP heartbeats go out at this interval and a peer is dropped after three missed (:class:`ZmqEndpoint`); the
    FFN replicas' probes ping at it too (:mod:`afd_sdk.runtime.replica_beacon`).
    """
    return min(max(timeout_s / 6, 0.05), 2.0)


def endpoint_address(transport: str, host: str, port: int, ipc_dir: str | None, name: str) -> str:
    """``tcp://host:port`` or ``ipc://<ipc_dir>/afd-<port>-<name>``."""
    if transport == "tcp":
        return f"tcp://{host}:{port}"
    if transport == "ipc":
        base = ipc_dir or os.environ.get("TMPDIR", "/tmp")
        return f"ipc://{base}/afd-{port}-{name}"
    raise AFDConfigError(
        f"afd.connector_extra_config.transport={transport!r} is invalid; expected 'tcp' or 'ipc'",
        key="afd.connector_extra_config.transport",
        value=transport,
    )


def bindable(address: str, wait_s: float = 0.0) -> str:
    """``address`` with a host name resolved to the address libzmq can bind (it binds no DNS names).

    ``afd.host`` may name the FFN rank 0 (a Kubernetes pod's stable name, ``afd-ffn-0.afd-ffn``): the
    attention side connects to the name, the FFN side binds the address it resolves to on its own host.
    A name that does not resolve yet (a pod's DNS record appears after the pod) is retried for ``wait_s``.
    """
    if not address.startswith("tcp://"):
        return address
    host, sep, port = address[len("tcp://") :].rpartition(":")
    if not sep or host in ("*", "") or host.startswith("["):
        return address
    try:
        ipaddress.ip_address(host)
        return address
    except ValueError:
        pass
    try:
        # IPv4, as libzmq resolves the name on the connecting side (its sockets leave ZMQ_IPV6 off)
        resolved = str(addrinfo(host, int(port), wait_s, family=socket.AF_INET)[0][4][0])
    except (OSError, ValueError) as exc:
        raise AFDConfigError(
            f"afd.host={host!r} does not resolve to an address this host can bind ({exc}); expected an IP "
            "address of this host or a name that resolves to one (the FFN rank's afd.ffn_hosts entry where given)",
            key="afd.host",
            value=host,
        ) from exc
    return f"tcp://{resolved}:{port}"


class ZmqEndpoint:
    """One ROUTER (binding side) or DEALER (connecting side) socket with liveness.

    Not thread-safe: one endpoint is used by one thread at a time (the
    connectors keep one endpoint per stage for that reason). With
    ``watch=True`` a daemon thread owns the monitor socket and keeps the
    liveness counters current even while nobody calls the endpoint; only
    :attr:`lost_for` may be read from other threads.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        kind: Literal["bind", "connect"],
        address: str,
        *,
        timeout_s: float,
        identity: bytes | None = None,
        peer_name: str = "peer",
        resolve_wait_s: float = 0.0,
        watch: bool = False,
    ) -> None:
        # resolved before any socket exists (a name waits up to resolve_wait_s for its DNS record)
        bind_address = bindable(address, resolve_wait_s) if kind == "bind" else address
        self.kind = kind
        self.address = address
        self.timeout_s = timeout_s
        self.peer_name = peer_name
        #: connections that completed the ZMTP handshake / that dropped since
        self.connected = 0
        self.disconnects = 0
        #: monotonic time of the first disconnect not yet forgiven by a rendezvous (None: none)
        self._lost_at: float | None = None
        self._lock = threading.Lock()  # the counters, when a watching thread updates them
        self._watcher: threading.Thread | None = None
        self._stop_watch = threading.Event()
        #: set by :meth:`await_peer` for the watching thread: count every event already queued, then forgive;
        #: a byte on the pipe wakes the thread from its poll
        self._forgive: threading.Event | None = None
        self._wake_r = self._wake_w = -1
        #: the socket file this endpoint bound (removed at close: libzmq leaves it when the
        #: process exits before its I/O thread has closed the listener)
        self.ipc_path: str | None = None
        self.sock = ctx.socket(zmq.ROUTER if kind == "bind" else zmq.DEALER)
        ivl_ms = int(heartbeat_interval_s(timeout_s) * 1000)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ivl_ms)
        self.sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * ivl_ms)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        # blocking receives wake up every slice to check liveness and the deadline
        self.slice_ms = max(1, min(50, int(timeout_s * 250)))
        self.sock.setsockopt(zmq.RCVTIMEO, self.slice_ms)
        if kind == "bind":
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        else:
            self.sock.setsockopt(zmq.RECONNECT_IVL, 50)
        if identity is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.monitor = self.sock.get_monitor_socket(_MONITORED)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        if not watch:
            self.poller.register(self.monitor, zmq.POLLIN)
        try:
            if kind == "bind":
                self.sock.bind(bind_address)
                if address.startswith("ipc://"):
                    self.ipc_path = address[len("ipc://") :]
            else:
                self.sock.connect(address)
        except zmq.ZMQError as exc:
            self.close()
            where = address if bind_address == address else f"{address} ({bind_address})"
            raise ConnectorError(f"cannot {kind} ZMQ socket at {where}: {exc}") from exc
        if watch:
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            # from here on the thread owns the monitor socket (it closes it, too)
            self._watcher = threading.Thread(target=self._watch, name=f"afd-liveness {address}", daemon=True)
            self._watcher.start()

    def _count(self, event: int) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected += 1
        elif event == zmq.EVENT_DISCONNECTED and self.connected > 0:
            self.connected -= 1
            self.disconnects += 1
            if self._lost_at is None:
                self._lost_at = time.monotonic()

    def _drain_monitor(self) -> None:
        if self._watcher is not None:
            return  # the watching thread keeps the counters current
        while self.monitor.poll(0):
            self._count(parse_monitor_message(self.monitor.recv_multipart())["event"])

    def _watch(self) -> None:
        """The watching thread: count monitor events as they come, until :meth:`close` stops it."""
        monitor = self.monitor
        poller = zmq.Poller()
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop_watch.is_set():
                ready = dict(poller.poll(_WATCH_POLL_MS))
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 64)
                    except BlockingIOError:  # another wake already read it: the flag below is what counts
                        pass
                forgive = self._forgive
                while (forgive is not None or monitor in ready) and monitor.poll(0):
                    # with a forgiveness pending, every event already queued (an earlier connection's drop) is
                    # counted before it, so none is counted after it
                    event = parse_monitor_message(monitor.recv_multipart())["event"]
                    if event == zmq.EVENT_MONITOR_STOPPED:
                        return
                    with self._lock:
                        self._count(event)
                    if forgive is None:
                        break
                if forgive is not None:
                    with self._lock:
                        self._forget_losses()
                    self._forgive = None
                    forgive.set()
        except zmq.ZMQError as exc:  # the context was terminated under us: nothing left to watch
            logger.debug("liveness watch of %s ended: %s", self.address, exc)
        except Exception:  # the counters would freeze: this endpoint can no longer vouch for its peer
            logger.exception("the liveness watch of %s failed; its peer counts as lost", self.address)
            with self._lock:
                self.disconnects += 1
                self._lost_at = self._lost_at or time.monotonic()
        finally:
            monitor.close(linger=0)

    def lost_for(self, tolerated_disconnects: int = 0) -> float | None:
        """Seconds since the peer's connection dropped, or ``None`` while it has not (thread-safe).

        Meaningful for a watched endpoint, which counts disconnects while idle;
        ``tolerated_disconnects`` as in :meth:`wait` (peers that said goodbye).
        """
        with self._lock:
            if self.disconnects <= tolerated_disconnects or self._lost_at is None:
                return None
            return time.monotonic() - self._lost_at

    def wait(
        self,
        deadline: float | None,
        what: str,
        *,
        tolerated_disconnects: int = 0,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """Block until a message is readable; ``PeerLostError`` on disconnect or deadline.

        ``deadline=None`` waits as long as the peer is alive (heartbeats).
        ``stop``: also return, with nothing readable, once it is true (looked
        at every slice, at most a second apart).
        A disconnect only counts once no message is left to read, so a peer's
        last words (a goodbye) are always delivered first; the caller passes
        ``tolerated_disconnects`` = goodbyes it has already received.
        """
        while True:
            if self.sock.poll(0, zmq.POLLIN) or (stop is not None and stop()):
                return
            self._drain_monitor()
            if self.disconnects > tolerated_disconnects:
                if self.sock.poll(0, zmq.POLLIN):
                    return
                raise PeerLostError(
                    f"{self.peer_name} at {self.address} disconnected while this side waited for {what}"
                )
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise PeerLostError(f"no {what} from {self.peer_name} at {self.address} within {self.timeout_s:g}s")
            # a watched endpoint's poller holds the data socket only: wake every slice to read the counters
            cap = self.slice_ms if self._watcher is not None else 1000
            timeout_ms = cap if remaining is None else max(1, min(cap, int(remaining * 1000) + 1))
            self.poller.poll(timeout_ms)

    def recv_first(self, deadline: float | None, what: Callable[[], str], *, tolerated_disconnects: int = 0) -> bytes:
        """Receive the first frame of the next message (hot path).

        A plain blocking ``recv`` — the same syscalls as raw pyzmq — that wakes
        every ``slice_ms`` to check liveness and the deadline; later frames of
        the same multipart message are already here and need no wait. ``what``
        builds the error text only when one is raised.
        """
        while True:
            try:
                return self.sock.recv()
            except zmq.Again:
                self.check(deadline, what(), tolerated_disconnects)

    def check(self, deadline: float | None, what: str, tolerated_disconnects: int = 0) -> None:
        """``PeerLostError`` when a peer dropped (and left nothing to read) or ``deadline`` passed; else return.

        Non-blocking: for data paths that wait elsewhere (NIXL notifications,
        shared memory) and ask the control plane every few milliseconds.
        """
        self._drain_monitor()
        if self.disconnects > tolerated_disconnects and not self.sock.poll(0, zmq.POLLIN):
            raise PeerLostError(f"{self.peer_name} at {self.address} disconnected while this side waited for {what}")
        if deadline is not None and time.monotonic() >= deadline:
            raise PeerLostError(f"no {what} from {self.peer_name} at {self.address} within {self.timeout_s:g}s")

    def deadline(self) -> float:
        return time.monotonic() + self.timeout_s

    def await_peer(
        self,
        deadline: float,
        budget_s: float,
        what: Callable[[], str],
        *,
        log_every_s: float = 10.0,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """Rendezvous wait: block until a message is readable, until ``deadline`` (``budget_s`` after the start).

        Unlike :meth:`wait`, a peer that is not there yet (or restarts) is not an
        error: the connecting side keeps reconnecting. Logs who is awaited every
        ``log_every_s``; ``PeerLostError`` naming the budget when it runs out;
        ``DrainedError`` once ``stop()`` is true (looked at every second).
        Afterwards the liveness counters start afresh: the peer just answered.
        """
        start = deadline - budget_s
        next_log = start + log_every_s
        while not self.sock.poll(0, zmq.POLLIN):
            if stop is not None and stop():
                raise DrainedError(f"drained while waiting for {what()} from {self.peer_name} at {self.address}")
            now = time.monotonic()
            if now >= deadline:
                raise PeerLostError(
                    f"no {what()} from {self.peer_name} at {self.address} within afd.connect_timeout_s={budget_s:g}s"
                )
            slice_s = min(log_every_s if stop is None else 1.0, deadline - now, max(0.001, next_log - now))
            if self.sock.poll(max(1, int(slice_s * 1000)), zmq.POLLIN):
                break
            now = time.monotonic()
            if next_log <= now < deadline:
                next_log = now + log_every_s
                logger.info(
                    "still waiting for %s from %s at %s (%.0fs of afd.connect_timeout_s=%gs)",
                    what(),
                    self.peer_name,
                    self.address,
                    time.monotonic() - start,
                    budget_s,
                )
        self._forget_queued_losses()

    def _forget_losses(self) -> None:
        self.disconnects = 0
        self._lost_at = None

    def _forget_queued_losses(self) -> None:
        """Start the liveness counters afresh, after every monitor event already queued is counted.

        The peer has just answered, so a drop queued before its answer (it restarted, or reconnected) is
        forgiven. Without a watching thread the caller drains the monitor itself; with one, the thread that
        owns the monitor drains it and forgives, and this waits for it (counting an old drop after the reset
        would raise a spurious ``PeerLostError`` at the next wait).
        """
        watcher = self._watcher
        if watcher is None:
            self._drain_monitor()
            self._forget_losses()
            return
        done = threading.Event()
        self._forgive = done
        os.write(self._wake_w, b"f")
        # the thread answers within a poll; one that ended (closed, failed) never will
        while not done.wait(_WATCH_POLL_MS / 1000):
            if not watcher.is_alive():
                self._forgive = None
                with self._lock:
                    self._forget_losses()
                return

    def close(self, linger_ms: int = 1000) -> None:
        """Close monitor and socket; pending outgoing messages get ``linger_ms`` to leave."""
        sock, monitor = getattr(self, "sock", None), getattr(self, "monitor", None)
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:
            self._stop_watch.set()
        if sock is not None and not sock.closed:
            try:
                sock.disable_monitor()  # sends MONITOR_STOPPED: a watching thread wakes and closes the monitor
            except zmq.ZMQError as exc:  # monitor already gone: nothing to stop
                logger.debug("disable_monitor on %s: %s", self.address, exc)
        if watcher is not None:
            watcher.join(timeout=10 * _WATCH_POLL_MS / 1000)  # it polls the stop flag every _WATCH_POLL_MS
            if watcher.is_alive():  # a context's term() would then wait for its monitor socket: say why
                logger.warning("the liveness watch of %s did not stop within %d ms", self.address, 10 * _WATCH_POLL_MS)
        elif monitor is not None and not monitor.closed:
            monitor.close(linger=0)
        wake = (getattr(self, "_wake_r", -1), getattr(self, "_wake_w", -1))
        if wake[0] >= 0 and (watcher is None or not watcher.is_alive()):  # a live thread still polls the read end
            self._wake_r = self._wake_w = -1
            for fd in wake:
                os.close(fd)
        if sock is not None and not sock.closed:
            sock.close(linger=linger_ms)
        ipc_path, self.ipc_path = getattr(self, "ipc_path", None), None
        if ipc_path is not None:
            try:
                os.unlink(ipc_path)
            except FileNotFoundError:  # libzmq's I/O thread removed it first
                pass
