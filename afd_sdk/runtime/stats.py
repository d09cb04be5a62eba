"""What a server loop reports, and the check both server loops run first."""

from __future__ import annotations

from dataclasses import dataclass, field

from afd_sdk.connector import ConnectorBase
from afd_sdk.errors import ConnectorError

__all__ = ["ServeStats", "require_serving"]


@dataclass
class ServeStats:
    steps: int = 0
    exchanges: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    wall_s: float = 0.0
    per_step: list[float] = field(default_factory=list)
    #: tokens of each step, summed over its stages and attention peers (what the control plane announced)
    step_tokens: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {"steps": self.steps, "exchanges": self.exchanges, "tokens": self.tokens,
                "compute_s": self.compute_s, "wall_s": self.wall_s, "step_tokens": self.step_tokens}  # fmt: skip


def require_serving(connector: ConnectorBase, server: str) -> None:
    """Raise ``ConnectorError`` unless ``connector`` was initialised (both servers call it first)."""
    if not connector.is_initialized:
        raise ConnectorError(f"{server}.serve() needs an initialised connector; call connector.init() first")
