"""``ZmqAFDConnector``'s own data path without its contract: the ``wire`` baseline of ``afd bench connector``.

The ``zmq`` baseline is bare pyzmq: one frame, no tensor. This one moves what
the connector moves, the way the connector moves it, and nothing else:

* one multipart message per direction through the connector's wire
  (:mod:`afd_connectors.zmq.wire`: the native module where it runs), with a
  header frame as long as the connector's;
* a receive below ``RECV_COPY_MAX`` bytes copied into a fixed area; from there
  up a tensor made over the received frame (``torch.frombuffer`` + ``view``),
  since a connector returns tensors;
* the FFN echoes that tensor back zero-copy, as the connector sends an output.

No role, stage, shape or order check, no header cache, no send record. So
``connector ÷ wire`` is what the connector's contract costs per round trip, and
``wire ÷ zmq`` what its transport choices cost against bare pyzmq.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import zmq

from afd_connectors.zmq.connector import RECV_COPY_MAX
from afd_connectors.zmq.wire import select_wire
from afd_sdk.control.endpoint import terminate_context
from afd_sdk.wire import TensorHeader, TensorSpec, encode_header

__all__ = ["RawZmqWire"]

_HIDDEN = 1024  # the benchmark's hidden size: fp32, 4 KiB per token


def _header(kind: str, tokens: int) -> bytes:
    """A header of the connector's length for ``tokens`` tokens (its content is not read)."""
    spec = TensorSpec("hidden_states", "float32", (tokens, _HIDDEN))
    return encode_header(TensorHeader(kind, 0, 0, (tokens,), (spec,)))


class RawZmqWire:
    """DEALER (attention) / ROUTER (FFN) over tcp, through the connector's wire; see the module docstring."""

    def __init__(self, role: str, *, host: str, port: int, max_bytes: int, timeout_s: float) -> None:
        self.ctx = zmq.Context(io_threads=1)
        self.sock = self.ctx.socket(zmq.ROUTER if role == "ffn" else zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        if role == "ffn":
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            self.sock.connect(f"tcp://{host}:{port}")
        self.wire = select_wire("auto")
        self.handle = self.wire.handle(self.sock)
        self.area = torch.empty(RECV_COPY_MAX, dtype=torch.uint8)
        self.into = ((self.area.data_ptr(), RECV_COPY_MAX - 1),)

    def _recv(self, nbytes_parts: int, nbytes: int) -> list[Any]:
        parts = self.wire.recv(self.handle, nbytes_parts, self.into if nbytes < RECV_COPY_MAX else None)
        if parts is None:
            raise TimeoutError("raw zmq wire: the peer sent nothing within the timeout")
        return parts

    def attention_round_trip(self, payload: torch.Tensor) -> Callable[[], None]:
        tokens = payload.numel() // _HIDDEN
        shape, nbytes = (tokens, _HIDDEN), payload.nbytes
        parts_out = [_header("a2f", tokens), self.wire.part(payload)]
        send, recv, handle, dtype = self.wire.send, self._recv, self.handle, payload.dtype

        def rt() -> None:
            send(handle, parts_out)
            got = recv(1, nbytes)[1]
            if got.__class__ is not int:
                torch.frombuffer(got, dtype=dtype).view(*shape)

        return rt

    def ffn_echo(self, count: int, nbytes: int) -> None:
        tokens = nbytes // (4 * _HIDDEN)
        shape, header = (tokens, _HIDDEN), _header("f2a", tokens)
        area = self.area[:nbytes].view(torch.float32).view(shape) if nbytes < RECV_COPY_MAX else None
        send, part, recv, handle = self.wire.send, self.wire.part, self._recv, self.handle
        for _ in range(count):
            ident, _hdr, got = recv(2, nbytes)
            out = area if got.__class__ is int else torch.frombuffer(got, dtype=torch.float32).view(*shape)
            send(handle, [ident, header, part(out)])

    def close(self) -> None:
        self.sock.close()
        terminate_context(self.ctx, "the raw ZMQ baseline", linger_s=0.0)
