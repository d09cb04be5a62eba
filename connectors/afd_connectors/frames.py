"""Tensor <-> raw-buffer helpers shared by the byte-stream connectors (zmq, shm).

A tensor goes out as a ``memoryview`` over its own storage (no copy) and comes
back as a view over a reused receive buffer (:class:`BufferPool`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from afd_sdk.connector import ExtraSpec
from afd_sdk.errors import ConnectorError
from afd_sdk.wire import TensorSpec, dtype_from_name, dtype_to_name

__all__ = ["tensor_bytes", "spec_of", "nbytes_of", "BufferPool", "check_extras"]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A read-only byte view of a contiguous CPU tensor's storage; holds a reference to it."""
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, dtype_to_name(t.dtype), tuple(t.shape))


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

    def raw(self, key: object, nbytes: int) -> torch.Tensor:
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 64), dtype=torch.uint8)
            self._bufs[key] = buf
        return buf[:nbytes]

    def tensor(self, key: object, spec: TensorSpec) -> tuple[torch.Tensor, memoryview]:
        """A tensor of ``spec`` over the pooled buffer, and the writable byte view to fill it."""
        nbytes = nbytes_of(spec)
        raw = self.raw(key, nbytes)
        view = memoryview(raw.numpy()) if nbytes else memoryview(bytearray())
        return raw.view(dtype_from_name(spec.dtype)).view(spec.shape), view

    def clear(self) -> None:
        self._bufs.clear()


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
