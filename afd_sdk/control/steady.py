"""What every connector's steady state shares: the bounded plan cache and the native steady-state protocol
(beside the contract's send record, :class:`afd_sdk.connector.SendRecord`).

A decode step repeats the same (layer, stage, tokens, dtype) exchanges, so a connector does its full checks
once per such key and remembers what they decided (a *plan*: an encoded header, a landing buffer, a peer); the
next call with that key only looks the plan up. Built-in connectors keep that steady state in C++ where their
torch extension is built (``afd_connectors.native``) and in Python otherwise. The Python path keeps its plans in
a :class:`PlanCache`; a native steady state keeps its own maps under the same bound (:data:`PLAN_CACHE_LIMIT`),
and shares the send record, a plain ``dict`` subclass it can hold and update.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    import torch

    from afd_sdk.wire import TransferMetadata

__all__ = ["PLAN_CACHE_LIMIT", "AttentionSteadyState", "FFNSteadyState", "PlanCache", "SteadyState"]

K = TypeVar("K")
V = TypeVar("V")

#: the default bound of a :class:`PlanCache`: far above a serving run's distinct (layer, stage, tokens) keys
#: per step, small enough that a run whose token counts keep changing (prefill) does not grow without bound
PLAN_CACHE_LIMIT = 4096


class PlanCache(dict[K, V], Generic[K, V]):
    """A memo of a connector's steady state, cleared whole when it reaches ``limit`` entries.

    Who writes it: the connector that owns it, after the full checks of a call passed for a key. Who reads it: the
    same connector's next call with that key (a native steady state keeps its own maps, bounded alike). What it may
    assume: a plan depends only on its key and on state fixed between ``open()`` and ``release()``; a connector
    clears its caches in ``release()``. Token counts change from step to step while serving, so the bound drops
    everything at once (a clear is O(n) once per ``limit`` inserts, and the next calls simply take the checked path
    again) instead of tracking recency on the hot path.
    """

    __slots__ = ("limit",)

    def __init__(self, limit: int = PLAN_CACHE_LIMIT) -> None:
        super().__init__()
        if limit < 1:
            raise ValueError(f"limit={limit} is invalid; expected at least 1")
        self.limit = limit

    def remember(self, key: K, value: V) -> V:
        """Store ``value`` under ``key`` (clearing the cache first when full) and return it."""
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value


@runtime_checkable
class AttentionSteadyState(Protocol):
    """The attention half of a connector's native steady state (see :class:`SteadyState`)."""

    def attn_send(self, hidden_states: torch.Tensor, metadata: TransferMetadata) -> bool:
        """Serve ``send_attn_output`` for a key the checked path accepted before: ``True`` when sent (the send
        record updated), ``False`` having changed nothing (the connector's checked path then runs)."""
        ...

    def attn_recv(self, ref_tensor: torch.Tensor, stage_idx: int) -> Any:
        """Serve ``recv_ffn_output``: the output tensor, ``None`` having changed nothing, or a connector-specific
        partial result (a received message) that the connector's Python completes and checks."""
        ...


@runtime_checkable
class FFNSteadyState(Protocol):
    """The FFN half of a connector's native steady state (see :class:`SteadyState`)."""

    def ffn_recv(self, stage_idx: int) -> Any:
        """Serve ``recv_attn_output``: the payload, ``None`` having changed nothing, or a connector-specific
        partial result that the connector's Python completes and checks."""
        ...

    def ffn_send(self, output: torch.Tensor, metadata: TransferMetadata) -> bool:
        """Serve ``send_ffn_output``: ``True`` when sent, ``False`` having changed nothing."""
        ...


@runtime_checkable
class SteadyState(AttentionSteadyState, FFNSteadyState, Protocol):
    """A connector's native steady state: one native call per contract call, declining what it cannot serve.

    The protocol the built-in C++ steady states follow (``afd_connectors.zmq._zmqsteady``,
    ``afd_connectors.shm._shmsteady``; ``afd_connectors.p2p._p2pwire`` serves the attention half), for any
    connector that moves its steady state into native code:

    * **Who calls it, when.** The connector's own contract method, first thing, with the contract's arguments;
      the object exists only between ``open()`` and ``release()`` (which calls :meth:`clear`).
    * **Decline, never fail.** For anything it has not been taught (a new key, a wait longer than its fast
      path, extras, fan-in, any check that would fail) it returns ``False`` / ``None`` *having changed
      nothing*, and the connector's checked Python path runs and raises the error every connector raises. So
      every error message, first use of a key and rare case lives once, in Python.
    * **Taught by the checked path.** After the checked path served a call, it hands the steady state what it
      decided (a connector-specific ``remember_*`` call with the plan: header bytes, landing buffer, peer);
      plans are bounded like a :class:`PlanCache` (cleared whole at :data:`PLAN_CACHE_LIMIT`).
    * **The same checks.** A served call makes the checked path's checks on the tensor's fields (shape, dtype,
      device, contiguity) and the per-call state (no send pending on the stage, the step's announcement) itself.
    * **The send record.** It holds the connector's :class:`~afd_sdk.connector.SendRecord` and updates it
      exactly as ``record_send`` / ``take_send`` would.

    There is one steady state per call: where a native one is built, the Python path is the checked path
    (plus a memo of its own plans where the native module is missing: that is an isolated install's fast
    path). ``tests/test_steady_protocol.py`` checks the built-ins against this protocol.
    """

    def clear(self) -> None:
        """Drop every plan and reference to the connector's buffers (called by ``release()``)."""
        ...
