"""``FFNServer``: a standalone FFN process — no scheduler, no KV cache, no serving engine."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from afd_sdk.connector import AFDConnector, AsyncDispatchConnector
from afd_sdk.errors import ConnectorError

__all__ = ["FFNServer", "ServeStats"]

FFNFunction = Callable[[int, torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]
#: routed experts of one layer on rows grouped by local expert: ``(layer_idx, rows, group_list) -> outputs``
ExpertsFunction = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ServeStats:
    steps: int = 0
    exchanges: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    wall_s: float = 0.0
    per_step: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {"steps": self.steps, "exchanges": self.exchanges, "tokens": self.tokens,
                "compute_s": self.compute_s, "wall_s": self.wall_s}  # fmt: skip


class FFNServer:
    """Serves every layer of every step for the FFN rank's attention peers.

    ``ffn(layer_idx, hidden_states, extras)`` computes one layer's FFN on the
    fanned-in tokens (``FFNBlocks`` from the transformers binding). With a
    control plane, each step starts with one merged ``ControlPayload`` and
    runs ``num_layers × num_stages`` exchanges in (layer, stage) order;
    ``serve()`` returns when every peer said goodbye and raises
    ``PeerLostError`` when one died. Async-dispatch connectors (no control
    plane) are served through their work items: ``ffn`` is then
    ``(layer_idx, rows, group_list)`` (``RoutedExperts``), stages are polled
    round-robin, and ``serve()`` returns when ``recv_ffn_work_item`` says every
    attention rank left; ``max_steps`` then counts work items.
    """

    def __init__(
        self, connector: AFDConnector, ffn: FFNFunction | ExpertsFunction, *, max_steps: int | None = None
    ) -> None:
        self.connector = connector
        self.ffn = ffn
        self.max_steps = max_steps
        self.stats = ServeStats()

    def serve(self) -> ServeStats:
        """Run until the attention side says goodbye (or ``max_steps`` steps were served)."""
        conn = self.connector
        if not conn.is_initialized:
            raise ConnectorError("FFNServer.serve() needs an initialised connector; call connector.init() first")
        cp = conn.control_plane
        if cp is None:
            if isinstance(conn, AsyncDispatchConnector):
                return self._serve_work_items(conn)
            raise ConnectorError(
                f"{type(conn).__name__} has no control plane and is no AsyncDispatchConnector; the FFN server "
                "needs one of the two to know what work comes next"
            )
        start = time.perf_counter()
        stats = self.stats
        with torch.inference_mode():
            while self.max_steps is None or stats.steps < self.max_steps:
                payload = cp.recv()
                if payload is None:
                    break
                cp.apply(payload)
                t0 = time.perf_counter()
                for _ in range(payload.num_layers):
                    for stage in range(payload.num_stages):
                        a = conn.recv_attn_output(stage)
                        c0 = time.perf_counter()
                        out = self.ffn(a.metadata.layer_idx, a.hidden_states, a.extras)  # type: ignore[arg-type]
                        stats.compute_s += time.perf_counter() - c0
                        conn.send_ffn_output(out, a.metadata)
                        stats.exchanges += 1
                        stats.tokens += a.metadata.num_tokens
                stats.per_step.append(time.perf_counter() - t0)
                stats.steps += 1
        stats.wall_s = time.perf_counter() - start
        return stats

    def _serve_work_items(self, conn: AsyncDispatchConnector) -> ServeStats:
        start = time.perf_counter()
        stats = self.stats
        num_stages = conn.config.num_stages
        stage = 0
        with torch.inference_mode():
            while self.max_steps is None or stats.exchanges < self.max_steps:
                item = conn.recv_ffn_work_item(stage)
                if item is None:
                    break
                c0 = time.perf_counter()
                out = self.ffn(item.layer_idx, item.hidden_states, item.group_list)  # type: ignore[arg-type]
                stats.compute_s += time.perf_counter() - c0
                conn.send_ffn_work_item_output(item, out)
                stats.exchanges += 1
                stats.tokens += item.num_tokens
                stage = (stage + 1) % num_stages
        stats.wall_s = time.perf_counter() - start
        return stats
