"""What a CAM backend implements, and what it may read from the connector that owns it.

Both sides are protocols so that the backends (``cam.portable``,
``cam.ascend``) and the rendezvous depend on this module only, never on the
connector module that constructs them: no import cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from afd_sdk.adapter import MoELayout
    from afd_sdk.config import AFDConfig
    from afd_sdk.connector import ConnectorContext
    from afd_sdk.dispatch import FFNWorkItem
    from afd_sdk.topology import AttentionFirstWorld

__all__ = ["CamBackend", "CamHost"]


class CamHost(Protocol):
    """The connector as a backend sees it (``CAMAsyncAFDConnector`` satisfies it)."""

    name: str
    config: AFDConfig
    context: ConnectorContext
    role: str
    role_rank: int
    world: AttentionFirstWorld
    moe: MoELayout
    extra: Any
    device: Any
    dtype: torch.dtype
    hidden_size: int

    @property
    def world_rank(self) -> int: ...
    def local_experts(self) -> range: ...
    def describe(self) -> dict[str, Any]: ...


class CamBackend(Protocol):
    """What a CAM backend implements; the connector validates arguments before calling it.

    ``dispatch`` returns the backend's handle of that dispatch (or ``None``); the connector keeps it in its
    per-stage FIFO with the routing and hands it back to ``combine``.
    """

    def init(self) -> None: ...
    def close(self) -> None: ...
    def dispatch(
        self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, layer: int, stage: int
    ) -> Any: ...
    def combine(
        self,
        ref_tensor: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        layer: int,
        stage: int,
        handle: Any,
    ) -> torch.Tensor: ...
    def recv_work_item(self, stage: int) -> FFNWorkItem | None: ...
    def send_work_item_output(self, item: FFNWorkItem, output: torch.Tensor) -> None: ...
