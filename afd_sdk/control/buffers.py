"""Grow-only receive buffers reused across layers, so the hot path allocates nothing."""

from __future__ import annotations

import math

import torch

from afd_sdk.wire import TensorSpec, dtype_from_name

__all__ = ["BufferPool", "DeviceBuffers", "nbytes_of"]


def nbytes_of(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * dtype_from_name(spec.dtype).itemsize


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


class DeviceBuffers:
    """Grow-only per-key tensors on one device (receive buffers reused across layers).

    :meth:`get` hands back the very same view while a key asks for the same
    rows, shape, dtype and device (every layer of a step does), so the hot path
    costs one dict lookup and a few compares, not a slice.
    """

    def __init__(self) -> None:
        self._bufs: dict[object, torch.Tensor] = {}
        self._views: dict[object, tuple[int, tuple[int, ...], torch.dtype, torch.device, torch.Tensor]] = {}

    def get(
        self, key: object, rows: int, trailing: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A ``[rows, *trailing]`` tensor for ``key``, valid until the next ``get`` of ``key`` that grows it."""
        memo = self._views.get(key)
        if memo is not None and memo[0] == rows and memo[1] == trailing and memo[2] is dtype and memo[3] == device:
            return memo[4]
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
        view = buf[:rows]
        self._views[key] = (rows, tuple(trailing), dtype, device, view)
        return view

    def clear(self) -> None:
        self._bufs.clear()
        self._views.clear()
