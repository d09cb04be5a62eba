"""The bounded plan cache every connector's steady state uses (beside the contract's send record,
:class:`afd_sdk.connector.SendRecord`).

A decode step repeats the same (layer, stage, tokens, dtype) exchanges, so a connector does its full checks
once per such key and remembers what they decided (a *plan*: an encoded header, a landing buffer, a peer); the
next call with that key only looks the plan up. Built-in connectors keep that steady state in C++ where their
torch extension is built (``afd_connectors.native``) and in Python otherwise; both read and write the two
structures, which is why they are plain ``dict`` subclasses that native code can hold and update.
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["PLAN_CACHE_LIMIT", "PlanCache"]

K = TypeVar("K")
V = TypeVar("V")

#: the default bound of a :class:`PlanCache`: far above a serving run's distinct (layer, stage, tokens) keys
#: per step, small enough that a run whose token counts keep changing (prefill) does not grow without bound
PLAN_CACHE_LIMIT = 4096


class PlanCache(dict[K, V], Generic[K, V]):
    """A memo of a connector's steady state, cleared whole when it reaches ``limit`` entries.

    Who writes it: the connector that owns it, after the full checks of a call passed for a key (and, for a
    native steady state, the native code through the same ``dict``). Who reads it: the same connector's next call
    with that key. What it may assume: a plan depends only on its key and on state fixed between ``open()`` and
    ``release()``; a connector clears its caches in ``release()``. Token counts change from step to step while
    serving, so the bound drops everything at once (a clear is O(n) once per ``limit`` inserts, and the next
    calls simply take the checked path again) instead of tracking recency on the hot path.
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
