"""``afd_connectors.zmq._zmqwire`` on its own: one multipart message per call on pyzmq's sockets."""

import errno
import time

import pytest
import torch
import zmq

from afd_connectors.zmq.wire import native_wire_problem
from afd_sdk.control import ZERO_COPY_MIN
from afd_sdk.runtime.world import free_port_block

pytestmark = pytest.mark.skipif(
    native_wire_problem() is not None, reason=f"the native wire cannot run here: {native_wire_problem()}"
)


@pytest.fixture
def wire():
    from afd_connectors.zmq import _zmqwire

    return _zmqwire


@pytest.fixture
def sockets():
    """A ROUTER and a DEALER (identity b"a0") connected over tcp, 50 ms receive slices."""
    ctx = zmq.Context(io_threads=1)
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (router, dealer):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 50)
    dealer.setsockopt(zmq.IDENTITY, b"a0")
    port = free_port_block(1)
    router.bind(f"tcp://127.0.0.1:{port}")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    yield router, dealer
    router.close()
    dealer.close()
    ctx.term()


def _wait_released(wire) -> None:
    deadline = time.monotonic() + 5
    while wire.pending() and time.monotonic() < deadline:  # libzmq frees on its I/O thread
        time.sleep(0.01)
    assert wire.pending() == 0


def test_a_receive_slice_without_a_message_returns_none(wire, sockets):
    router, _ = sockets
    t0 = time.monotonic()
    assert wire.recv(router.underlying, 2) is None
    assert time.monotonic() - t0 < 2


def test_parts_arrive_in_order_as_bytes_copies_and_frames(wire, sockets):
    router, dealer = sockets
    small, large = torch.arange(16, dtype=torch.float32), torch.arange(ZERO_COPY_MIN, dtype=torch.float32)
    wire.send(
        dealer.underlying,
        [b"header", (small, small.data_ptr(), small.nbytes), (large, large.data_ptr(), large.nbytes), b""],
    )
    area = torch.zeros(64, dtype=torch.float32)
    # part 2 (the 64-byte tensor) fits its area; part 3 (256 KiB) does not; part 4 has no area
    ident, header, copied, frame, empty = wire.recv(router.underlying, 2, ((area.data_ptr(), area.nbytes), None))
    assert (ident, header, copied) == (b"a0", b"header", small.nbytes)
    assert torch.equal(area[:16], small)
    got = torch.frombuffer(frame, dtype=torch.float32)
    assert torch.equal(got, large)
    got[0] = -1  # a writable buffer over the received message
    assert len(empty) == 0
    _wait_released(wire)


def test_a_buffer_part_stays_exported_until_libzmq_sent_it(wire, sockets):
    router, dealer = sockets
    payload = bytearray(b"x" * (4 * ZERO_COPY_MIN))
    wire.send(dealer.underlying, [payload])
    _, data = wire.recv(router.underlying, 1)
    assert bytes(data) == bytes(payload)
    _wait_released(wire)
    payload.extend(b"y")  # the export was released: the bytearray may be resized again


def test_errors_are_pyzmq_errors_with_libzmq_errno(wire, sockets):
    router, _ = sockets
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    with pytest.raises(zmq.ZMQError) as exc:
        wire.send(router.underlying, [b"nobody", b"x"])
    assert exc.value.errno == errno.EHOSTUNREACH
    with pytest.raises(ValueError, match=r"part 0: \(owner, address, nbytes\)"):
        wire.send(router.underlying, [(None, 0, 8)])
    with pytest.raises(TypeError, match="into must be a tuple"):
        wire.recv(router.underlying, 1, [(0, 0)])
