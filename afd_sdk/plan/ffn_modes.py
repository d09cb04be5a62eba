"""Timed calls of an FFN role's layers on captured hidden states: the FFN curves of ``afd plan calibrate``, for the
reference runtime's FFN role and vLLM's alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["FFNModes", "grouped_rows"]


def grouped_rows(hidden: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An FFN rank's input under routed dispatch: each token's row once per expert it chose, grouped by expert
    (``[tokens * top_k, hidden]``), and the rows per expert (``group_list``)."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return hidden[order // topk_ids.shape[1]].contiguous(), torch.bincount(flat, minlength=num_experts)


class FFNModes:
    """Timed calls of the FFN role's layers on ``n`` rows of captured hidden states (routed: grouped by the
    experts their tokens chose, as an FFN rank holding every expert receives them)."""

    def __init__(self, ffn: Any, layers: list[int], routed_experts: int) -> None:
        self.ffn, self.layers, self.routed_experts = ffn, layers, routed_experts

    def mode(self, rows: list[torch.Tensor], topk: list[torch.Tensor], n: int) -> Callable[[], None]:
        reps = -(-n // rows[0].shape[0])
        hs = [torch.cat([h] * reps)[:n] for h in rows]
        ffn, layers = self.ffn, self.layers
        if self.routed_experts:
            grouped = [
                grouped_rows(h, torch.cat([t] * reps)[:n], self.routed_experts) for h, t in zip(hs, topk, strict=True)
            ]

            def routed() -> None:
                with torch.inference_mode():
                    for layer, (rows_, counts) in zip(layers, grouped, strict=True):
                        ffn(layer, rows_, counts)

            return routed

        def fan_in() -> None:
            with torch.inference_mode():
                for i, layer in enumerate(layers):
                    ffn(layer, hs[i], {})

        return fan_in
