"""Draining an FFN process: ``POST /drain`` on its ops endpoint, an idempotent operation with an id.

A drained FFN process serves the step in progress to its end, says goodbye to its attention peers and
exits 0. With ``afd.ffn_replicas`` > 1 its attention ranks take the goodbye as a lost replica and go on with
the next one (docs/operations.md): a rolling restart or a move of an FFN replica without restarting any
attention engine. Without replicas the world ends, as it does when the attention side says goodbye. Routed
dispatch drains with redundant experts only: its attention ranks route the rank's experts to their other
holders at their next dispatch and say goodbye to it once nothing of theirs is in flight there.

The operation is idempotent: the first request with an id starts the drain (202), a repeat of the same id
answers its state (200), a request with another id while one drain is under way is a conflict (409).
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

from afd_sdk.connector import AFDConnector, ConnectorBase

logger = logging.getLogger(__name__)

__all__ = ["Drain"]

#: an operation id: what an orchestrator would use (a UUID, a job name, a rollout revision)
_OP_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


class Drain:
    """One FFN process's drain: the operation that started it and the worlds (connectors) it stops.

    Thread-safe: the ops endpoint's threads call :meth:`request`, the serving threads :meth:`attach` each
    world's connector before its ``init()`` (a standby still waiting for its peers is drained too).
    ``unsupported``: the connector's name when this process serves a connector that cannot drain: every
    request is refused with 501. A connector other than an :class:`AFDConnector` drains when it has
    ``drain_refusal()`` and that returns ``None`` (routed dispatch with redundant experts); otherwise its
    reason (or a default one) is the 501's.
    """

    def __init__(self, unsupported: str | None = None) -> None:
        self._lock = threading.Lock()
        self._worlds: list[ConnectorBase] = []
        self.unsupported = unsupported
        self._refusal: str | None = None if unsupported is None else _no_step_boundary(unsupported)
        self.op: str | None = None
        self.done = False

    @property
    def requested(self) -> bool:
        return self.op is not None

    def attach(self, connector: ConnectorBase) -> None:
        """Stop ``connector``'s world when the drain is requested (at once when it already was)."""
        with self._lock:
            if not isinstance(connector, AFDConnector):
                refusal = getattr(connector, "drain_refusal", None)
                why = _no_step_boundary(connector.display_name) if refusal is None else refusal()
                if why is not None:
                    self.unsupported = self.unsupported or connector.display_name
                    self._refusal = self._refusal or why
                    return
            self._worlds.append(connector)
            if self.op is None:
                return
        connector.request_stop()

    def finish(self) -> None:
        """Every world ended after the drain (called by the serving thread): the state is ``drained``."""
        with self._lock:
            self.done = True
        logger.warning("afd: drain %r done: every world ended", self.op)

    def request(self, op: object) -> tuple[int, dict[str, Any]]:
        """``POST /drain``'s answer to operation ``op``: (HTTP status, JSON body)."""
        if not isinstance(op, str) or not _OP_ID.fullmatch(op):
            return 400, {
                "error": f"op={op!r} is invalid; expected an operation id of 1-128 characters [A-Za-z0-9._:-] "
                "(POST /drain?op=<id>)"
            }
        with self._lock:
            if self._refusal is not None:
                return 501, {"error": self._refusal}
            if self.op is None:
                self.op = op
                worlds = list(self._worlds)
            elif self.op == op:
                return 200, self.state()
            else:
                return 409, {
                    "error": f"op={op!r} conflicts with drain {self.op!r} under way; expected op={self.op!r} "
                    "(a repeat answers its state)",
                    **self.state(),
                }
        logger.warning("afd: drain %r: serving the step in progress, then goodbye to the attention peers", op)
        for world in worlds:
            world.request_stop()
        return 202, self.state()

    def state(self) -> dict[str, Any]:
        """``{"op": ..., "state": "draining" | "drained"}`` (``op`` ``None`` before any request)."""
        return {"op": self.op, "state": "drained" if self.done else "draining"}


def _no_step_boundary(name: str) -> str:
    return (
        f"drain is not supported by {name}: routed dispatch serves work items with no step boundary on the FFN "
        "side; expected a point-to-point connector, or CAM with connector_extra_config.expert_replicas > 1"
    )
