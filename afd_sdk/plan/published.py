"""Published AFD figures, recomputed by the planner from the inputs their authors state (``afd plan paper``).

Each row: the source, what is compared, the published value and the planner's, in the same unit.
"""

from __future__ import annotations

from typing import Any

from afd_sdk.plan.hardware import HardwareSpec, exchange_budget

__all__ = ["STEPMESH_SPEC", "reproduce"]

#: StepMesh (StepFun's AFD communication library, Step-3): 2A2F, 128 tokens per attention rank, hidden 7168,
#: A2F in FP8 (1 byte), F2A in BF16 (2 bytes), 161.3 Gbps per FFN GPU; DeepSeek-V3-style routing (256 experts,
#: top-8). Only the figures the budget needs are given: nothing else is assumed.
STEPMESH_SPEC: dict[str, Any] = {
    "name": "StepMesh 2A2F per-layer budget",
    "dispatch": "routed",
    "model": {
        "hidden_size": 7168,
        "num_layers": 61,
        "num_experts": 256,
        "top_k": 8,
        "a2f_bytes_per_element": 1,
        "f2a_bytes_per_element": 2,
    },
    "link": {"gbits_per_s": 161.3, "latency_us": 0.0},
}

#: the published per-layer budget: A2F 91 µs + F2A 182 µs = 273 µs
STEPMESH_PUBLISHED_US = {"a2f_us": 91.0, "f2a_us": 182.0, "total_us": 273.0}


def reproduce() -> list[dict[str, Any]]:
    """Every published figure the planner recomputes, with its own value beside it."""
    spec = HardwareSpec.from_dict(STEPMESH_SPEC)
    budget = exchange_budget(spec, attention=2, ffn=2, batch=128)
    rows = []
    for key, what in (("a2f_us", "A2F (FP8) per layer"), ("f2a_us", "F2A (BF16) per layer"), ("total_us", "total")):
        rows.append(
            {
                "source": "StepMesh (2A2F, batch 128, hidden 7168, 161.3 Gbps per FFN GPU)",
                "figure": what,
                "published": STEPMESH_PUBLISHED_US[key],
                "planner": budget[key],
                "unit": "us",
            }
        )
    return rows
