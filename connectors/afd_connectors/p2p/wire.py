"""How ``P2pNcclAFDConnector`` makes its process-group calls: ``native`` (C++) or ``python``.

Both wires make the same calls on the same groups in the same order; only the
language around them differs. :mod:`afd_connectors.p2p._p2pwire` (C++ against
c10d) also runs the attention side's steady state (``attn_send`` /
``attn_recv``): the contract's checks read the tensor's fields directly, so a
round trip's Python shrinks to two calls (``docs/connectors.md`` has the
figures). :class:`PythonWire` serves where the C++ module is not built (pip
builds it only when torch is importable at build time, i.e. with
``--no-build-isolation``) and is the reference the native wire is tested
against; it has no steady state of its own, and the connector runs its
memoised Python checks instead.

A failed wait raises ``RuntimeError`` (the connector names the layer and
stage in the ``PeerLostError`` it raises from it).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any, Literal

import torch

from afd_connectors import native
from afd_sdk.errors import ConnectorError

_p2pwire, _IMPORT_PROBLEM = native.load("p2p._p2pwire")  # a torch extension, checked against this torch

__all__ = ["PythonWire", "WireName", "make_wire", "native_wire_problem"]

WireName = Literal["auto", "native", "python"]


def native_wire_problem() -> str | None:
    """Why the native wire cannot run in this process, or ``None`` when it can."""
    if _p2pwire is None:
        return _IMPORT_PROBLEM
    return None


class PythonWire:
    """The process-group calls in Python, one :class:`_Stage` per micro-batch stage; see the module docstring."""

    name = "python"

    def __init__(self, groups: Sequence[Any], peers: Sequence[int], timeout_s: float) -> None:
        self._stages = [_Stage(pg) for pg in groups]
        self._peer = peers[0]
        self._timeout = datetime.timedelta(seconds=timeout_s)

    def send(self, stage: int, parts: Sequence[tuple[torch.Tensor, int]]) -> None:
        st = self._stages[stage]
        for t, peer in parts:
            st.sends.append(st.pg.send([t], peer, 0))
            st.keep.append(t)

    def attn_post(self, stage: int, tensors: Sequence[torch.Tensor], out0: torch.Tensor, out1: torch.Tensor) -> None:
        st = self._stages[stage]
        st.out = (out0, out1)
        pg, peer = st.pg, self._peer
        for t in tensors:
            st.sends.append(pg.send([t], peer, 0))
            st.keep.append(t)
        st.flip ^= 1
        out = st.out[st.flip]
        st.posted = (pg.recv([out], peer, 0), out)

    def attn_finish(self, stage: int) -> torch.Tensor:
        st = self._stages[stage]
        posted, st.posted = st.posted, None
        st.finish_sends(self._timeout)
        if posted is None:
            raise RuntimeError(f"stage {stage} has no receive posted")
        posted[0].wait(self._timeout)
        return posted[1]

    def ffn_plan(self, stage: int, posts: Sequence[tuple[torch.Tensor, int]]) -> None:
        self._stages[stage].posts = tuple(posts)

    def ffn_wait_plan(self, stage: int) -> None:
        st = self._stages[stage]
        st.finish_sends(self._timeout)
        pg, timeout = st.pg, self._timeout
        if len(st.posts) == 1:
            t, peer = st.posts[0]
            pg.recv([t], peer, 0).wait(timeout)
            return
        for work in [pg.recv([t], peer, 0) for t, peer in st.posts]:
            work.wait(timeout)

    def ffn_send_one(self, stage: int, t: torch.Tensor, peer: int) -> None:
        st = self._stages[stage]
        st.sends.append(st.pg.send([t], peer, 0))
        st.keep.append(t)

    def clear(self) -> None:
        for st in self._stages:
            st.__init__(st.pg)  # type: ignore[misc]


class _Stage:
    """One stage's group and what is in flight on it (the native wire's ``Stage``)."""

    __slots__ = ("flip", "keep", "out", "pg", "posted", "posts", "sends")

    def __init__(self, pg: Any) -> None:
        self.pg = pg
        self.sends: list[Any] = []
        self.keep: list[torch.Tensor] = []  # the tensors the sends read, alive until they complete
        self.posted: tuple[Any, torch.Tensor] | None = None
        self.out: tuple[torch.Tensor, torch.Tensor] | None = None
        self.flip = 0
        self.posts: tuple[tuple[torch.Tensor, int], ...] = ()

    def finish_sends(self, timeout: datetime.timedelta) -> None:
        sends, self.sends, self.keep = self.sends, [], []
        for work in sends:
            work.wait(timeout)


def make_wire(
    name: WireName,
    groups: Sequence[Any],
    peers: Sequence[int],
    timeout_s: float,
    *,
    dtype: torch.dtype,
    device: torch.device,
    hidden: int,
    control: Any,
    sent: dict[int, Any],
) -> Any:
    """The wire ``connector_extra_config.wire`` names: ``auto`` is native where it imports, else python."""
    if name == "python" or (name == "auto" and _p2pwire is None):
        return PythonWire(groups, peers, timeout_s)
    problem = native_wire_problem()
    if problem is not None:  # validate_config refuses wire='native' first; this is the last guard
        raise ConnectorError(f"connector_extra_config.wire='native' cannot run here: {problem}")
    return _p2pwire.P2pWire(list(groups), list(peers), timeout_s, dtype, device, hidden, control, sent)
