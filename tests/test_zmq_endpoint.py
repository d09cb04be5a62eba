"""afd.host may be a host name: the binding side binds the address it resolves to (libzmq binds no names)."""

from __future__ import annotations

import time

import pytest
import zmq

from afd_sdk.control.endpoint import ZmqEndpoint, bindable
from afd_sdk.errors import AFDConfigError
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
