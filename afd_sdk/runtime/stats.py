"""What a server loop reports, and the check both server loops run first."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from afd_sdk.connector import ConnectorBase
from afd_sdk.errors import ConnectorError

__all__ = ["STEP_HISTORY", "ServeStats", "payload_bytes", "require_serving"]


#: how many recent steps :class:`ServeStats` keeps per-step figures for (a server runs for millions of steps)
STEP_HISTORY = 4096


def _history() -> deque[Any]:
    return deque(maxlen=STEP_HISTORY)


@dataclass
class ServeStats:
    """What a server loop did: totals since it started, and per-step figures of the last :data:`STEP_HISTORY` steps."""

    steps: int = 0
    exchanges: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    wall_s: float = 0.0
    #: seconds of each recent step, from its first receive to its last reply
    per_step: deque[float] = field(default_factory=_history)
    #: tokens of each recent step, summed over its stages and attention peers (what the control plane announced)
    step_tokens: deque[int] = field(default_factory=_history)

    def as_dict(self) -> dict[str, object]:
        return {
            "steps": self.steps,
            "exchanges": self.exchanges,
            "tokens": self.tokens,
            "compute_s": self.compute_s,
            "wall_s": self.wall_s,
            "step_tokens": list(self.step_tokens),
        }


def require_serving(connector: ConnectorBase, server: str) -> None:
    """Raise ``ConnectorError`` unless ``connector`` was initialised (both servers call it first)."""
    if not connector.is_initialized:
        raise ConnectorError(f"{server}.serve() needs an initialised connector; call connector.init() first")


def payload_bytes(hidden_states: torch.Tensor, extras: Mapping[str, torch.Tensor] | None = None) -> int:
    """Bytes of one exchange's payload: the hidden states and every extra (what ``/metrics`` counts)."""
    n = hidden_states.nbytes
    if extras:
        for t in extras.values():
            n += t.nbytes
    return n
