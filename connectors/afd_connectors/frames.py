"""Tensor <-> raw-buffer helpers shared by the byte-stream connectors (zmq, shm).

A tensor goes out as a ``memoryview`` over its own storage (no copy) and comes
back as a view over a reused receive buffer (:class:`BufferPool`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from afd_sdk.connector import ExtraSpec
from afd_sdk.errors import ConnectorError, WireFormatError
from afd_sdk.wire import TensorHeader, TensorSpec, TransferMetadata, dtype_from_name, dtype_to_name

__all__ = [
    "TENSOR_DTYPES",
    "ZERO_COPY_MIN",
    "BufferPool",
    "DeviceBuffers",
    "check_extras",
    "nbytes_of",
    "recv_tensor",
    "send_frames",
    "spec_of",
    "tensor_bytes",
    "tensor_header",
]

#: dtypes the built-in byte-moving connectors carry
TENSOR_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "int8", "uint8", "int32", "int64"})
#: below this size a copy into a new zmq message is cheaper than tracking a zero-copy frame
ZERO_COPY_MIN = 65536
_SNDMORE = 2  # zmq.SNDMORE as a plain int: IntFlag arithmetic costs µs per frame
_DTYPE_NAME: dict[torch.dtype, str] = {}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A read-only byte view of a contiguous CPU tensor's storage; holds a reference to it."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    if t.dtype is torch.bfloat16 or (t.dtype.is_floating_point and t.dtype.itemsize == 1):
        t = t.view(torch.int16 if t.dtype is torch.bfloat16 else torch.uint8)  # numpy has no such dtype
    return memoryview(t.numpy()).cast("B")


def writable_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (for memcpy into it)."""
    if t.numel() == 0:
        return memoryview(bytearray())
    if t.dtype is torch.bfloat16 or (t.dtype.is_floating_point and t.dtype.itemsize == 1):
        t = t.view(torch.int16 if t.dtype is torch.bfloat16 else torch.uint8)
    return memoryview(t.numpy()).cast("B")


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    dt = _DTYPE_NAME.get(t.dtype)
    if dt is None:
        dt = _DTYPE_NAME[t.dtype] = dtype_to_name(t.dtype)
    return TensorSpec(name, dt, tuple(t.shape))


def recv_tensor(sock: object, spec: TensorSpec, pool: BufferPool, key: object) -> torch.Tensor:
    """Receive the next frame as a tensor of ``spec``.

    Small frames are copied into a reused pooled buffer (cheaper than a frame
    object); large ones are adopted zero-copy from the ZMQ message itself.
    """
    nbytes = nbytes_of(spec)
    if nbytes >= ZERO_COPY_MIN:
        frame = sock.recv(copy=False)  # type: ignore[attr-defined]
        buf = frame.buffer
        if buf.nbytes != nbytes:
            raise WireFormatError(f"tensor frame {spec.name!r} has {buf.nbytes} bytes; the header announced {nbytes}")
        return torch.frombuffer(buf, dtype=dtype_from_name(spec.dtype)).view(spec.shape)
    tensor, view = pool.tensor(key, spec)
    got = sock.recv_into(view)  # type: ignore[attr-defined]
    if got != nbytes:
        raise WireFormatError(f"tensor frame {spec.name!r} has {got} bytes; the header announced {nbytes}")
    return tensor


def tensor_header(
    kind: str,
    metadata: TransferMetadata,
    seq_lens: tuple[int, ...],
    names: Sequence[str],
    tensors: Sequence[torch.Tensor],
) -> TensorHeader:
    """The typed header of one message: ``names[i]`` describes ``tensors[i]``."""
    specs = tuple(spec_of(n, t) for n, t in zip(names, tensors, strict=True))
    return TensorHeader(kind, metadata.layer_idx, metadata.stage_idx, seq_lens, specs)


def send_frames(sock: object, frames: Sequence[bytes | memoryview]) -> None:
    """Send one multipart message: small frames copied, large ones zero-copy."""
    last = len(frames) - 1
    send = sock.send  # type: ignore[attr-defined]
    for i, frame in enumerate(frames):
        send(frame, 0 if i == last else _SNDMORE, copy=len(frame) < ZERO_COPY_MIN)


def nbytes_of(spec: TensorSpec) -> int:
    n = 1
    for d in spec.shape:
        n *= d
    return n * dtype_from_name(spec.dtype).itemsize


class BufferPool:
    """Grow-only byte buffers keyed by slot; reused across calls to avoid allocation.

    A tensor returned from :meth:`tensor` is valid until the same key is
    requested again.
    """

    def __init__(self) -> None:
        self._bufs: dict[object, torch.Tensor] = {}
        # steady state: the same key asks for the same spec every layer -> reuse the views too
        self._views: dict[object, tuple[TensorSpec, torch.Tensor, memoryview]] = {}

    def raw(self, key: object, nbytes: int) -> torch.Tensor:
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 64), dtype=torch.uint8)
            self._bufs[key] = buf
            self._views.pop(key, None)
        return buf[:nbytes]

    def tensor(self, key: object, spec: TensorSpec) -> tuple[torch.Tensor, memoryview]:
        """A tensor of ``spec`` over the pooled buffer, and the writable byte view to fill it."""
        cached = self._views.get(key)
        if cached is not None and cached[0] == spec:
            return cached[1], cached[2]
        nbytes = nbytes_of(spec)
        raw = self.raw(key, nbytes)
        view = memoryview(raw.numpy()) if nbytes else memoryview(bytearray())
        tensor = raw.view(dtype_from_name(spec.dtype)).view(spec.shape)
        self._views[key] = (spec, tensor, view)
        return tensor, view

    def clear(self) -> None:
        self._bufs.clear()
        self._views.clear()


def check_extras(
    declared: Sequence[ExtraSpec], extras: Mapping[str, torch.Tensor] | None, num_tokens: int
) -> list[torch.Tensor]:
    """Validate extras against the model's declaration; return them in declaration order."""
    extras = extras or {}
    names = [e.name for e in declared]
    if set(extras) != set(names):
        raise ConnectorError(
            f"extras={sorted(extras)} do not match the model's declared FFN extras {names}; "
            "send exactly the declared extras"
        )
    out = []
    for spec in declared:
        t = extras[spec.name]
        want = (num_tokens, *spec.trailing_shape)
        if tuple(t.shape) != want or dtype_to_name(t.dtype) != spec.dtype:
            raise ConnectorError(
                f"extra {spec.name!r} is {dtype_to_name(t.dtype)}{list(t.shape)}; expected {spec.dtype}{list(want)}"
            )
        out.append(t)
    return out


class DeviceBuffers:
    """Grow-only per-key tensors on one device (receive buffers reused across layers)."""

    def __init__(self) -> None:
        self._bufs: dict[object, torch.Tensor] = {}

    def get(
        self, key: object, rows: int, trailing: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        buf = self._bufs.get(key)
        if (
            buf is None
            or buf.shape[0] < rows
            or buf.dtype != dtype
            or buf.device != device
            or buf.shape[1:] != trailing
        ):
            buf = torch.empty((max(rows, 1), *trailing), dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf[:rows]

    def clear(self) -> None:
        self._bufs.clear()
