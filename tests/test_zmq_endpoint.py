"""The ZMQ endpoint: afd.host may be a host name (libzmq binds no names), and its liveness counters are exact."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq

from afd_sdk.control import endpoint
from afd_sdk.control.endpoint import ZmqEndpoint, bindable, terminate_context
from afd_sdk.errors import AFDConfigError, ConnectorError
from afd_sdk.runtime.world import free_port_block


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("tcp://localhost:7000", "tcp://127.0.0.1:7000"),
        ("tcp://127.0.0.1:7000", "tcp://127.0.0.1:7000"),
        ("tcp://*:7000", "tcp://*:7000"),
        ("ipc:///tmp/afd-7000-ctl", "ipc:///tmp/afd-7000-ctl"),
    ],
)
def test_bindable_resolves_names_only(address, expected):
    assert bindable(address) == expected


def test_an_unresolvable_name_is_a_config_error_naming_the_key():
    with pytest.raises(AFDConfigError, match=r"afd.host='no-such-host.invalid' does not resolve") as err:
        ZmqEndpoint(zmq.Context.instance(), "bind", "tcp://no-such-host.invalid:7000", timeout_s=1.0)
    assert err.value.key == "afd.host"


def test_both_sides_meet_at_a_host_name():
    ctx = zmq.Context()
    port = free_port_block(1)
    server = ZmqEndpoint(ctx, "bind", f"tcp://localhost:{port}", timeout_s=5.0)
    client = ZmqEndpoint(ctx, "connect", f"tcp://localhost:{port}", timeout_s=5.0, identity=b"a0")
    try:
        client.sock.send(b"hello")
        server.wait(time.monotonic() + 5.0, "hello")
        assert server.sock.recv_multipart() == [b"a0", b"hello"]
    finally:
        client.close()
        server.close()
        ctx.term()


def test_a_name_without_a_record_yet_is_retried_until_it_resolves(monkeypatch):
    """A pod's DNS record appears after the pod starts: the binding side waits for it (within its deadline)."""
    import socket

    real = socket.getaddrinfo
    calls = []

    def late(host, *args, **kw):
        calls.append(host)
        if host == "afd-ffn-0.afd-ffn" and len(calls) < 3:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real("127.0.0.1", *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", late)
    assert bindable("tcp://afd-ffn-0.afd-ffn:7000", wait_s=5.0) == "tcp://127.0.0.1:7000"
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(AFDConfigError, match="does not resolve"):
        bindable("tcp://afd-ffn-0.afd-ffn:7000", wait_s=0.0)


def test_a_drop_queued_before_a_rendezvous_is_forgiven_with_it(monkeypatch):
    """A peer reconnects; its old connection's drop is still queued for the watching thread when the new
    connection's first message ends the rendezvous. The drop must count before the counters start afresh,
    never after (that would be a spurious ``PeerLostError`` at the next wait). The watching thread is held
    between receiving the drop and counting it, so the order is forced, not left to timing."""
    import threading

    import afd_sdk.control.endpoint as endpoint

    ctx = zmq.Context()
    port = free_port_block(1)
    server = ZmqEndpoint(ctx, "bind", f"tcp://127.0.0.1:{port}", timeout_s=5.0, watch=True)
    peers: list[zmq.Socket] = []

    def connect(identity: bytes) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, identity)
        s.connect(f"tcp://127.0.0.1:{port}")
        peers.append(s)
        return s

    def rendezvous() -> None:
        server.await_peer(time.monotonic() + 5.0, 5.0, lambda: "hello")

    holding, release = threading.Event(), threading.Event()
    real_parse = endpoint.parse_monitor_message

    def held(frames):
        message = real_parse(frames)
        if message["event"] == zmq.EVENT_DISCONNECTED:
            holding.set()
            assert release.wait(10)
        return message

    try:
        connect(b"a0").send(b"hello")
        rendezvous()
        server.sock.recv_multipart()
        deadline = time.monotonic() + 5
        while server.connected != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.connected == 1
        monkeypatch.setattr(endpoint, "parse_monitor_message", held)
        drop_counted = threading.Event()
        count = server._count

        def counting(event: int) -> None:
            count(event)
            if event == zmq.EVENT_DISCONNECTED:
                drop_counted.set()

        monkeypatch.setattr(server, "_count", counting)
        peers.pop().close(linger=0)
        assert holding.wait(5), "the drop never reached the watching thread"
        connect(b"a1").send(b"hello again")  # the peer is back before its drop was counted
        waiter = threading.Thread(target=rendezvous)
        waiter.start()
        waiter.join(0.5)  # the rendezvous saw the message; it now waits for the held thread
        release.set()
        waiter.join(5)
        assert not waiter.is_alive()
        assert drop_counted.wait(5), "the held drop was never counted"
        deadline = time.monotonic() + 5
        while server.connected != 1 and time.monotonic() < deadline:  # the new connection's handshake
            time.sleep(0.01)
        assert (server.connected, server.disconnects, server.lost_for()) == (1, 0, None)
        server.check(time.monotonic() + 5.0, "the next step")  # no spurious PeerLostError
        assert server.sock.recv_multipart() == [b"a1", b"hello again"]
    finally:
        release.set()
        for s in peers:
            s.close(linger=0)
        server.close()
        ctx.term()


def test_terminating_a_context_returns_once_its_sockets_are_closed():
    ctx = zmq.Context()
    port = free_port_block(1)
    server = ZmqEndpoint(ctx, "bind", f"tcp://127.0.0.1:{port}", timeout_s=2.0)
    client = ZmqEndpoint(ctx, "connect", f"tcp://127.0.0.1:{port}", timeout_s=2.0, identity=b"a0")
    client.close()
    server.close()
    t0 = time.monotonic()
    terminate_context(ctx, "the test's context")
    assert ctx.closed and time.monotonic() - t0 < 2.0


def test_a_socket_left_open_fails_termination_by_its_deadline_naming_it(monkeypatch):
    """A socket the caller forgot would hold ``term()`` forever: the deadline turns it into an error."""
    monkeypatch.setattr(endpoint, "TERM_GRACE_S", 0.3)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    t0 = time.monotonic()
    try:
        with pytest.raises(
            ConnectorError,
            match=r"the ZMQ context of the test's context did not terminate within "
            r"0\.3 s: 1 of its sockets are still open \(ROUTER\)",
        ):
            terminate_context(ctx, "the test's context", linger_s=0.0)
        assert time.monotonic() - t0 < 2.0
    finally:
        sock.close(linger=0)  # the term() still waiting on its thread returns now


class _StuckContext:
    """A context whose ``term()`` never returns by itself, with every socket closed (libzmq's shutdown stuck)."""

    _sockets = ()

    def __init__(self) -> None:
        self.release = threading.Event()

    def term(self) -> None:
        self.release.wait(30)


def test_a_stuck_libzmq_shutdown_is_a_warning_by_the_deadline_not_a_hang(monkeypatch, caplog):
    monkeypatch.setattr(endpoint, "TERM_GRACE_S", 0.2)
    ctx = _StuckContext()
    t0 = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="afd_sdk.control.endpoint"):
            terminate_context(ctx, "a stuck context", linger_s=0.1)  # type: ignore[arg-type]
        assert time.monotonic() - t0 < 2.0
        assert "the ZMQ context of a stuck context did not terminate within 0.3 s" in caplog.text
    finally:
        ctx.release.set()


def test_an_error_from_term_reaches_the_caller():
    class Failing(_StuckContext):
        def term(self) -> None:
            raise zmq.ZMQError(zmq.EFAULT)

    with pytest.raises(zmq.ZMQError):
        terminate_context(Failing(), "a failing context")  # type: ignore[arg-type]
