"""The planner's model: the step of a deployment from a profile's per-layer costs.

Per decoder layer and micro-batch (``S`` stages split each attention rank's ``batch`` requests evenly; ``m``
tokens per micro-batch, the largest micro-batch setting the pace):

* attention ``a = attention_us(m)`` on each attention rank;
* FFN: fan-in, an FFN rank batches the ``g`` attention ranks of its block, ``ffn_us(g*m)``; routed, every token
  goes to the FFN ranks holding its top-k experts, so an FFN rank receives ``p*m`` of each rank's tokens,
  ``p = 1 - C(E - E/F, k)/C(E, k)`` (the probability a token needs it), and does ``1/F`` of all ranks' expert
  work, ``ffn_us(A*m/F)`` (uniform routing);
* exchange: the connector's round trip for one message of ``m`` tokens' hidden states (``p*m`` routed).

These costs are then scheduled as the runtime runs them, fill, drain, overlap and fan-in waits included, on the
host's cores (:mod:`afd_sdk.plan.simulate`); the step's fixed overhead (embedding, LM head, sampling) is added.
On dedicated accelerators (a hardware spec) every rank has its own device and nothing is shared.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from afd_sdk.errors import AFDConfigError
from afd_sdk.plan.profile import Host
from afd_sdk.plan.simulate import simulate_step

__all__ = ["Costs", "Deployment", "Prediction", "plan", "predict"]

_LABEL = re.compile(r"(\d+)A(\d+)F (\d+)S b(\d+)")


@dataclass(frozen=True)
class Deployment:
    """One configuration: ``attention`` ranks, ``ffn`` ranks, ``stages`` micro-batches, ``batch`` requests per
    attention rank per step."""

    attention: int
    ffn: int
    stages: int
    batch: int

    def check(self, dispatch: str, num_experts: int = 0) -> None:
        """Raise :class:`AFDConfigError` if the runtime cannot run this (``num_experts``: routed placement)."""
        for key in ("attention", "ffn", "stages", "batch"):
            if getattr(self, key) < 1:
                raise AFDConfigError(f"{key}={getattr(self, key)}; expected an int >= 1", key=key)
        if self.stages > self.batch:
            raise AFDConfigError(
                f"stages={self.stages} with batch={self.batch}; expected stages <= batch (a stage needs a request)",
                key="stages",
            )
        if dispatch == "fan_in" and self.attention < self.ffn:
            raise AFDConfigError(
                f"ffn={self.ffn} with attention={self.attention}; fan-in dispatch needs attention >= ffn "
                "(each attention rank feeds one FFN rank)",
                key="ffn",
            )
        if dispatch == "routed" and num_experts and num_experts % self.ffn:
            raise AFDConfigError(
                f"ffn={self.ffn} with {num_experts} experts; routed dispatch needs FFN ranks that divide the experts",
                key="ffn",
                value=self.ffn,
            )

    @property
    def label(self) -> str:
        return f"{self.attention}A{self.ffn}F {self.stages}S b{self.batch}"

    @classmethod
    def from_label(cls, label: str) -> Deployment:
        """The deployment a :attr:`label` names (``"2A1F 1S b8"``), as a profile's ``measured`` worlds record it."""
        m = _LABEL.fullmatch(label)
        if m is None:
            raise AFDConfigError(
                f"deployment={label!r}; expected a label like '2A1F 1S b8' (attention, FFN, stages, batch)",
                key="deployment",
                value=label,
            )
        return cls(*(int(g) for g in m.groups()))


@dataclass(frozen=True)
class Prediction:
    deployment: Deployment
    step_ms: float
    tokens_per_s: float
    tokens_per_s_per_rank: float
    attention_utilisation: float
    ffn_utilisation: float
    bottleneck: str
    #: the per-layer terms (microseconds) the step was built from
    attention_us: float
    ffn_us: float
    exchange_us: float

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["deployment"] = asdict(self.deployment)
        d["label"] = self.deployment.label
        return d


class Costs(Protocol):
    """What :func:`predict` needs: a calibrated :class:`~afd_sdk.plan.profile.Profile` or a
    :class:`~afd_sdk.plan.hardware.HardwareSpec`."""

    dispatch: str
    num_experts: int
    num_layers: int
    tokens_per_request: int
    step_overhead_us: float
    host: Host

    def layer_attention_us(self, tokens: int) -> float:
        """One attention rank's work per layer on a micro-batch of ``tokens``."""
        ...

    def layer_ffn_us(self, attention: int, ffn: int, group: int, tokens: int) -> float:
        """An FFN rank's work per layer and micro-batch, fed by ``group`` ranks of ``tokens`` each."""
        ...

    def layer_round_trip_us(self, attention: int, ffn: int, tokens: int) -> float:
        """One message's round trip (both directions, latency included) for ``tokens`` per attention rank."""
        ...

    def extra_message_us(self, round_trip_us: float) -> float:
        """An FFN rank's CPU for each message beyond the first it answers in one micro-batch."""
        ...


def predict(profile: Costs, dep: Deployment) -> Prediction:
    """The step of ``dep``: the runtime's schedule simulated on the profile's costs and cores
    (:mod:`afd_sdk.plan.simulate`), plus the step's fixed overhead."""
    dep.check(profile.dispatch, profile.num_experts)
    a_ranks, f_ranks, stages = dep.attention, dep.ffn, dep.stages
    # the runner's even split: the largest micro-batch sets the pace
    m = math.ceil(dep.batch / stages) * profile.tokens_per_request
    a = profile.layer_attention_us(m)
    c = profile.layer_round_trip_us(a_ranks, f_ranks, m)
    host = profile.host
    sched = simulate_step(
        attention=a_ranks,
        ffn=f_ranks,
        stages=stages,
        layers=profile.num_layers,
        attention_us=a,
        ffn_us=lambda group: profile.layer_ffn_us(a_ranks, f_ranks, group, m),
        round_trip_us=c,
        extra_message_us=profile.extra_message_us(c),
        routed=profile.dispatch == "routed",
        cores=host.slots,
        slowdown=host.slowdown,
    )
    # the embedding, final norm, LM head and sampling run on every attention rank at once
    busy = min(a_ranks, host.slots)
    overhead = profile.step_overhead_us * max(1.0, a_ranks / host.slots) * host.slowdown(int(busy))
    step_us = max(sched.step_us + overhead, 1e-3)
    tokens = a_ranks * dep.batch * profile.tokens_per_request
    tps = tokens / (step_us * 1e-6)
    att_util = sched.attention_busy_us / step_us
    ffn_util = sched.ffn_busy_us / step_us
    # over the layers' part of the step (the fixed overhead is neither role's pipeline)
    att_share, ffn_share = (b / max(sched.step_us, 1e-9) for b in (sched.attention_busy_us, sched.ffn_busy_us))
    if max(att_share, ffn_share) < 0.5:
        bottleneck = "exchange"  # neither role is busy half the layers' time: the ranks mostly wait on messages
    else:
        bottleneck = "attention" if att_share >= ffn_share else "ffn"
    return Prediction(
        deployment=dep,
        step_ms=step_us / 1000,
        tokens_per_s=tps,
        tokens_per_s_per_rank=tps / (a_ranks + f_ranks),
        attention_utilisation=min(1.0, att_util),
        ffn_utilisation=min(1.0, ffn_util),
        bottleneck=bottleneck,
        attention_us=a,
        ffn_us=profile.layer_ffn_us(a_ranks, f_ranks, sched.largest_group, m),
        exchange_us=c,
    )


def deployments(
    attention: Iterable[int],
    ffn: Iterable[int],
    stages: Iterable[int],
    batch: Iterable[int],
    dispatch: str,
    num_experts: int = 0,
) -> list[Deployment]:
    """Every valid combination, in a stable order (invalid ones left out: fan-in with A < F, more stages than
    requests, routed F that does not divide the experts)."""
    out = []
    for a, f, s, b in itertools.product(attention, ffn, stages, batch):
        dep = Deployment(a, f, s, b)
        try:
            dep.check(dispatch, num_experts)
        except AFDConfigError:
            continue
        out.append(dep)
    return out


def plan(
    profile: Costs, candidates: Iterable[Deployment], *, tpot_ms: float | None = None
) -> tuple[list[Prediction], Prediction | None]:
    """Predict every candidate; the best is the highest tokens/s per rank (each rank a device) whose step meets
    ``tpot_ms`` (a step produces one token per request in decode), ties to the shorter step."""
    preds = [predict(profile, d) for d in candidates]
    eligible = [p for p in preds if tpot_ms is None or p.step_ms <= tpot_ms]
    best = max(eligible, key=lambda p: (p.tokens_per_s_per_rank, -p.step_ms), default=None)
    return preds, best
