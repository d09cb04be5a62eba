"""``FFNServer``: a standalone FFN process for point-to-point connectors — no scheduler, no KV cache.

Routed-dispatch connectors have their own loop,
:class:`~afd_sdk.runtime.expert_server.ExpertServer`;
:func:`afd_sdk.runtime.serve.server_for` picks by the connector's declared
capability.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from afd_sdk.connector import AFDConnector
from afd_sdk.metrics import AFDMetrics
from afd_sdk.runtime.stats import ServeStats, payload_bytes, require_serving

__all__ = ["FFNFunction", "FFNServer", "ServeStats"]

#: one layer's FFN on the fanned-in tokens: ``(layer_idx, hidden_states, extras) -> output``
FFNFunction = Callable[[int, torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]


class FFNServer:
    """Serves every layer of every step for the FFN rank's attention peers.

    ``ffn(layer_idx, hidden_states, extras)`` computes one layer's FFN on the
    fanned-in tokens (``FFNBlocks`` from :mod:`afd_sdk.proxy`). Each step
    starts with one merged ``ControlPayload`` from the connector's control
    plane and runs ``num_layers × num_stages`` exchanges in (layer, stage)
    order (a step re-announced after a failover: those from its
    ``resume_layers`` on); ``serve()`` returns when every peer said goodbye (or
    after ``max_steps``) and raises ``PeerLostError`` when one died.
    """

    def __init__(
        self,
        connector: AFDConnector,
        ffn: FFNFunction,
        *,
        max_steps: int | None = None,
        metrics: AFDMetrics | None = None,
    ) -> None:
        self.connector = connector
        self.ffn = ffn
        self.max_steps = max_steps
        self.stats = ServeStats()
        #: where each exchange, step and compute is recorded for ``/metrics``; ``None``: not recorded
        self.metrics = metrics

    def serve(self) -> ServeStats:
        """Run until the attention side says goodbye (or ``max_steps`` steps were served)."""
        conn = self.connector
        require_serving(conn, "FFNServer")
        cp = conn.require_control_plane()
        start = time.perf_counter()
        stats = self.stats
        m = self.metrics
        clock = time.perf_counter
        with torch.inference_mode():
            while self.max_steps is None or stats.steps < self.max_steps:
                if cp.stop_requested:  # drained: the last step was served whole
                    break
                payload = cp.recv()
                if payload is None:
                    break
                cp.apply(payload)
                step_tokens = sum(map(sum, payload.stage_token_counts))
                stats.step_tokens.append(step_tokens)
                if m is not None:
                    m.observe_step(step_tokens)
                t0 = clock()
                resume = payload.resume_layers  # after an attention rank's failover: the step's remaining layers
                for layer in range(payload.num_layers):
                    for stage in range(payload.num_stages):
                        if resume and layer < resume[stage]:
                            continue
                        r0 = clock()
                        a = conn.recv_attn_output(stage)
                        c0 = clock()
                        out = self.ffn(a.metadata.layer_idx, a.hidden_states, a.extras)
                        c1 = clock()
                        stats.compute_s += c1 - c0
                        conn.send_ffn_output(out, a.metadata)
                        stats.exchanges += 1
                        stats.tokens += a.metadata.num_tokens
                        if m is not None:
                            m.observe_compute(c1 - c0, a.metadata.num_tokens)
                            received = payload_bytes(a.hidden_states, a.extras)
                            m.observe_exchange(stage, clock() - r0, out.nbytes, received)
                stats.per_step.append(time.perf_counter() - t0)
                stats.steps += 1
        stats.wall_s = time.perf_counter() - start
        return stats
