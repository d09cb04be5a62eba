"""``ExpertServer``: the FFN loop of routed-dispatch connectors (work items, no control plane)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from afd_sdk.dispatch import AsyncDispatchConnector
from afd_sdk.metrics import AFDMetrics
from afd_sdk.runtime.stats import ServeStats, require_serving

__all__ = ["ExpertServer", "ExpertsFunction"]

#: routed experts of one layer on rows grouped by local expert: ``(layer_idx, rows, group_list) -> outputs``
ExpertsFunction = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


class ExpertServer:
    """Serves one FFN rank's routed experts until every attention rank has left.

    ``experts(layer_idx, rows, group_list)`` computes the unweighted outputs
    of rows grouped by local expert (``RoutedExperts`` from
    :mod:`afd_sdk.proxy`). Stages are polled round-robin; ``serve()`` returns
    when ``recv_ffn_work_item`` reports that every attention rank said goodbye
    (or after ``max_items`` work items) and raises ``PeerLostError`` when one died.
    """

    def __init__(
        self,
        connector: AsyncDispatchConnector,
        experts: ExpertsFunction,
        *,
        max_items: int | None = None,
        metrics: AFDMetrics | None = None,
    ) -> None:
        self.connector = connector
        self.experts = experts
        self.max_items = max_items
        self.stats = ServeStats()
        #: where each work item is recorded for ``/metrics``; ``None``: not recorded
        self.metrics = metrics

    def serve(self) -> ServeStats:
        conn = self.connector
        require_serving(conn, "ExpertServer")
        start = time.perf_counter()
        stats = self.stats
        m = self.metrics
        # global id of this rank's first expert (RoutedExperts knows it), for the per-expert row counts
        first_expert = int(getattr(self.experts, "expert_start", 0))
        clock = time.perf_counter
        num_stages = conn.config.num_stages
        stage = 0
        with torch.inference_mode():
            while self.max_items is None or stats.exchanges < self.max_items:
                r0 = clock()
                item = conn.recv_ffn_work_item(stage)
                if item is None:
                    break
                c0 = clock()
                out = self.experts(item.layer_idx, item.hidden_states, item.group_list)
                c1 = clock()
                stats.compute_s += c1 - c0
                conn.send_ffn_work_item_output(item, out)
                stats.exchanges += 1
                stats.tokens += item.num_tokens
                if m is not None:
                    m.observe_compute(c1 - c0, item.num_tokens)
                    m.observe_exchange(stage, clock() - r0, out.nbytes, item.hidden_states.nbytes)
                    m.observe_expert_rows(first_expert, item.group_list.tolist())
                stage = (stage + 1) % num_stages
        stats.wall_s = time.perf_counter() - start
        return stats
