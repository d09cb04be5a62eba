"""How ``ZmqAFDConnector`` moves one whole multipart message: in C, or through pyzmq.

``afd bench connector --profile`` showed that the connector's cost over raw
pyzmq is Python per frame, two to four times dearer right after a blocking
wait. :class:`NativeWire` sends or receives a whole message in one call of
:mod:`afd_connectors.zmq._zmqwire` on the libzmq that pyzmq loaded (same library
instance, so the same sockets). :class:`PyzmqWire` does the same through
pyzmq; it serves where the native module is not built or libzmq cannot be
located in the process, and as the reference the native wire is tested against.

Both take the socket's handle (:meth:`Wire.handle`) and tensors as parts
(:meth:`Wire.part`); both return a received message as a list whose first
``nbytes_parts`` parts are ``bytes`` (identity, header) and the rest writable
buffers over the received memory, or ``None`` when the socket's receive
timeout passed first (the caller checks liveness and calls again). The native
wire also takes ``into``, one ``(address, capacity)`` per data part: a part
smaller than ``ZERO_COPY_MIN`` that fits is copied there and comes back as its
byte count, so the steady state creates no tensor per message. Send errors are
``zmq.ZMQError`` for both.
"""

from __future__ import annotations

import ctypes.util
import functools
from collections.abc import Sequence
from typing import Any, Literal, Protocol

import torch
import zmq

from afd_connectors import native
from afd_sdk.control.framing import ZERO_COPY_MIN, send_frames, tensor_bytes
from afd_sdk.errors import ConnectorError
from afd_sdk.wire import A2FPayload

_zmqwire, _IMPORT_PROBLEM = native.load("zmq._zmqwire")
_zmqsteady, _STEADY_PROBLEM = native.load("zmq._zmqsteady")  # a torch extension, checked against this torch

__all__ = ["NativeWire", "PyzmqWire", "Wire", "make_steady", "native_wire_problem", "select_wire", "steady_problem"]

WireName = Literal["auto", "native", "pyzmq"]


class Wire(Protocol):
    """One multipart message per call; see the module docstring."""

    name: str

    def handle(self, sock: zmq.Socket) -> Any: ...

    def part(self, t: torch.Tensor) -> Any: ...

    def send(self, handle: Any, parts: Sequence[Any]) -> None: ...

    def recv(self, handle: Any, nbytes_parts: int, into: tuple[Any, ...] | None = None) -> list[Any] | None: ...


def _loaded_libzmq() -> str | None:
    """The path of the libzmq this process loaded (pyzmq's bundled copy, or the system's)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "/libzmq" in path and ".so" in path:
                    return path
    except OSError:  # no /proc (not Linux): the dynamic linker's answer below is the best there is
        pass
    return ctypes.util.find_library("zmq")


@functools.cache
def native_wire_problem() -> str | None:
    """Why :class:`NativeWire` cannot run in this process, or ``None`` when it can (loads it once)."""
    if _zmqwire is None:
        return _IMPORT_PROBLEM
    zmq.zmq_version()  # pyzmq's backend, and with it libzmq, is loaded
    path = _loaded_libzmq()
    if path is None:
        return "the libzmq pyzmq loaded was not found in /proc/self/maps"
    try:
        _zmqwire.load(path, zmq.ZMQError, ZERO_COPY_MIN)
    except OSError as exc:
        return str(exc)
    return None


@functools.cache
def steady_problem() -> str | None:
    """Why :func:`make_steady` cannot run in this process, or ``None`` when it can (binds it once)."""
    problem = native_wire_problem()
    if problem is not None:
        return problem
    if _zmqsteady is None:
        return _STEADY_PROBLEM
    _zmqsteady.bind(_zmqwire._C_API)
    return None


def make_steady(handles: Sequence[int], hidden: int, sent: dict[int, Any], ident: bytes, limit: int) -> Any:
    """The connector's steady state in C++ (:mod:`afd_connectors.zmq._zmqsteady`) over the native wire's socket
    ``handles``, or ``None`` where it is not built; ``sent`` is the connector's send record, shared."""
    if steady_problem() is not None:
        return None
    return _zmqsteady.ZmqSteady(list(handles), hidden, sent, ident, limit, A2FPayload)


class NativeWire:
    """Whole messages in one C call each (:mod:`afd_connectors.zmq._zmqwire`).

    Parts of at least ``ZERO_COPY_MIN`` bytes go zero-copy; their tensors stay
    referenced until libzmq is done with them, without pyzmq's garbage thread.
    """

    name = "native"

    def __init__(self) -> None:
        problem = native_wire_problem()
        if problem is not None:
            raise ConnectorError(f"connector_extra_config.wire='native' cannot run here: {problem}")
        # the C functions themselves: no Python frame per message
        self.send = _zmqwire.send
        self.recv = _zmqwire.recv

    @staticmethod
    def handle(sock: zmq.Socket) -> int:
        return int(sock.underlying)

    @staticmethod
    def part(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        if not t.is_contiguous():
            t = t.contiguous()
        return (t, t.data_ptr(), t.nbytes)


class PyzmqWire:
    """Whole messages through pyzmq: small parts copied, large ones zero-copy."""

    name = "pyzmq"

    @staticmethod
    def handle(sock: zmq.Socket) -> zmq.Socket:
        return sock

    part = staticmethod(tensor_bytes)

    send = staticmethod(send_frames)  # the transport kit's: small frames copied, large ones zero-copy

    @staticmethod
    def recv(handle: zmq.Socket, nbytes_parts: int, into: tuple[Any, ...] | None = None) -> list[Any] | None:
        """``into`` is accepted and not used: every data part comes back as a buffer."""
        try:
            frames = handle.recv_multipart(copy=False)
        except zmq.Again:
            return None
        return [f.bytes if i < nbytes_parts else f.buffer for i, f in enumerate(frames)]


def select_wire(name: WireName) -> Wire:
    """The wire ``connector_extra_config.wire`` names: ``auto`` is native where it runs, else pyzmq."""
    if name == "pyzmq" or (name == "auto" and native_wire_problem() is not None):
        return PyzmqWire()
    return NativeWire()
