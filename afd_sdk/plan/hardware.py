"""Plan for hardware this machine does not have: a spec file of published or vendor figures instead of calibration.

A :class:`HardwareSpec` gives :func:`afd_sdk.plan.model.predict` the same per-layer costs a calibrated profile
gives, from rooflines (GEMM TFLOP/s and memory bandwidth per role) and the link (bandwidth and latency per FFN
device). The JSON file (every figure is the user's input; nothing is defaulted from a particular GPU)::

    {
      "name": "…",
      "model": {"hidden_size": 7168, "num_layers": 61, "num_experts": 256, "top_k": 8,
                "a2f_bytes_per_element": 1, "f2a_bytes_per_element": 2,
                "attention_flops_per_token": …, "attention_weight_bytes": …,
                "kv_bytes_per_token": …, "context_tokens": …,
                "expert_flops_per_token": …, "expert_weight_bytes": …},
      "attention": {"tflops": …, "memory_gbytes_per_s": …},
      "ffn": {"tflops": …, "memory_gbytes_per_s": …},
      "link": {"gbits_per_s": 161.3, "latency_us": 0.0},
      "dispatch": "routed"
    }

``*_flops_per_token`` and ``*_bytes`` are per decoder layer. The attention layer reads its weights once per
micro-batch and each token's KV cache of ``context_tokens``; the FFN reads the weights of each expert its tokens
hit (expected distinct experts of ``E/F``) and does ``expert_flops_per_token`` per routed assignment. The
exchange: an FFN device receives its tokens' hidden states at ``a2f_bytes_per_element`` and returns them at
``f2a_bytes_per_element``, over its link.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from afd_sdk.errors import AFDConfigError
from afd_sdk.plan.profile import DISPATCH_MODES, Host, read_json, routed_fraction

__all__ = ["HardwareSpec", "exchange_budget"]

#: accelerators do not share cores between ranks: the model's CPU-sharing factor stays 1
_DEDICATED = Host(cores=1 << 20, threads_per_process=1)


def _positive(raw: Mapping[str, Any], key: str, where: str, *, allow_zero: bool = False) -> float:
    try:
        value = float(raw[key])
    except KeyError:
        raise AFDConfigError(f"hardware spec has no {where}.{key}", key=f"{where}.{key}") from None
    except (TypeError, ValueError):
        raise AFDConfigError(
            f"{where}.{key}={raw[key]!r}; expected a number", key=f"{where}.{key}", value=raw[key]
        ) from None
    if value < 0 or (value == 0 and not allow_zero):
        raise AFDConfigError(
            f"{where}.{key}={value:g}; expected a number {'>=' if allow_zero else '>'} 0", key=f"{where}.{key}"
        )
    return value


def _count(model: Mapping[str, Any], key: str) -> int:
    value = _positive(model, key, "model")
    if value != int(value):
        raise AFDConfigError(f"model.{key}={value:g}; expected a whole number >= 1", key=f"model.{key}", value=value)
    return int(value)


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    dispatch: str
    hidden_size: int
    num_layers: int
    num_experts: int
    top_k: int
    a2f_bytes_per_element: float
    f2a_bytes_per_element: float
    link_bytes_per_s: float
    link_latency_us: float
    compute: Mapping[str, float]
    tokens_per_request: int = 1  # decode: one new token per request per step
    step_overhead_us: float = 0.0
    host: Host = _DEDICATED

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> HardwareSpec:
        model = raw.get("model", {})
        link = raw.get("link", {})
        dispatch = str(raw.get("dispatch", "routed"))
        if dispatch not in DISPATCH_MODES:
            raise AFDConfigError(f"dispatch={dispatch!r}; expected one of {', '.join(DISPATCH_MODES)}", key="dispatch")
        compute: dict[str, float] = {}
        for key in ("attention_flops_per_token", "attention_weight_bytes", "kv_bytes_per_token", "context_tokens"):
            compute[key] = _positive(model, key, "model", allow_zero=True) if key in model else 0.0
        for key in ("expert_flops_per_token", "expert_weight_bytes"):
            compute[key] = _positive(model, key, "model", allow_zero=True) if key in model else 0.0
        for role in ("attention", "ffn"):
            part = raw.get(role, {})
            compute[f"{role}_flops_per_s"] = _positive(part, "tflops", role) * 1e12 if "tflops" in part else math.inf
            compute[f"{role}_bytes_per_s"] = (
                _positive(part, "memory_gbytes_per_s", role) * 1e9 if "memory_gbytes_per_s" in part else math.inf
            )
        num_experts, top_k = _count(model, "num_experts"), _count(model, "top_k")
        if top_k > num_experts:
            raise AFDConfigError(
                f"model.top_k={top_k} with model.num_experts={num_experts}; expected top_k <= num_experts",
                key="model.top_k",
                value=top_k,
            )
        return cls(
            name=str(raw.get("name", "hardware spec")),
            dispatch=dispatch,
            hidden_size=_count(model, "hidden_size"),
            num_layers=_count(model, "num_layers"),
            num_experts=num_experts,
            top_k=top_k,
            a2f_bytes_per_element=_positive(model, "a2f_bytes_per_element", "model"),
            f2a_bytes_per_element=_positive(model, "f2a_bytes_per_element", "model"),
            link_bytes_per_s=_positive(link, "gbits_per_s", "link") * 1e9 / 8,
            link_latency_us=_positive(link, "latency_us", "link", allow_zero=True) if "latency_us" in link else 0.0,
            compute=compute,
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> HardwareSpec:
        return cls.from_dict(read_json(path, "hardware"))

    def at_context(self, context: int) -> HardwareSpec:
        """This spec with every token's KV cache holding ``context`` tokens (``model.context_tokens``)."""
        if context < 1:
            raise AFDConfigError(f"context={context}; expected an int >= 1", key="context", value=context)
        return replace(self, compute={**self.compute, "context_tokens": float(context)})

    def tokens_at_ffn(self, attention: int, ffn: int, tokens: int) -> float:
        """Hidden-state rows one FFN device receives per micro-batch (``tokens`` per attention rank)."""
        if self.dispatch == "fan_in":
            return math.ceil(attention / ffn) * tokens
        return attention * tokens * routed_fraction(self.num_experts, self.top_k, ffn)

    def exchange_us(self, attention: int, ffn: int, tokens: int) -> tuple[float, float]:
        """A2F and F2A microseconds per layer and micro-batch on one FFN device's link."""
        rows = self.tokens_at_ffn(attention, ffn, tokens)
        a2f = rows * self.hidden_size * self.a2f_bytes_per_element / self.link_bytes_per_s * 1e6
        f2a = rows * self.hidden_size * self.f2a_bytes_per_element / self.link_bytes_per_s * 1e6
        return a2f + self.link_latency_us, f2a + self.link_latency_us

    def layer_attention_us(self, tokens: int) -> float:
        c = self.compute
        return 1e6 * max(
            c["attention_flops_per_token"] * tokens / c["attention_flops_per_s"],
            (c["attention_weight_bytes"] + c["kv_bytes_per_token"] * c["context_tokens"] * tokens)
            / c["attention_bytes_per_s"],
        )

    def layer_ffn_us(self, attention: int, ffn: int, group: int, tokens: int) -> float:
        c = self.compute
        if self.dispatch == "routed":
            assignments = attention * tokens * self.top_k / ffn
            local = self.num_experts / ffn
        else:  # the FFN rank holds every expert and batches its group
            assignments = group * tokens * self.top_k
            local = float(self.num_experts)
        # expected distinct local experts the assignments hit (uniform routing)
        hit = local * (1 - (1 - 1 / local) ** assignments) if local else 0.0
        return 1e6 * max(
            c["expert_flops_per_token"] * assignments / c["ffn_flops_per_s"],
            c["expert_weight_bytes"] * hit / c["ffn_bytes_per_s"],
        )

    def layer_round_trip_us(self, attention: int, ffn: int, tokens: int) -> float:
        a2f, f2a = self.exchange_us(attention, ffn, tokens)
        return a2f + f2a

    def extra_message_us(self, round_trip_us: float) -> float:
        """0: the link time already carries every rank's rows to the FFN device (:meth:`tokens_at_ffn`)."""
        return 0.0


def exchange_budget(spec: HardwareSpec, *, attention: int, ffn: int, batch: int) -> dict[str, float]:
    """The per-layer exchange on one FFN device for ``batch`` tokens per attention rank: A2F, F2A and total µs."""
    a2f, f2a = spec.exchange_us(attention, ffn, batch)
    return {
        "a2f_us": a2f,
        "f2a_us": f2a,
        "total_us": a2f + f2a,
        "rows_per_ffn": spec.tokens_at_ffn(attention, ffn, batch),
    }
