"""What calibration measured: per-layer time curves, the connector's round trip, the host. Saved as JSON.

A profile is the planner's only input about this machine. Every curve is a
set of measured points ``(x, microseconds)``; between points the model
interpolates linearly, beyond the last it extrapolates the last segment's
slope (costs grow at least linearly in tokens or bytes), below the first it
scales the first point's cost toward zero in proportion, never below the
first segment's line.
"""

from __future__ import annotations

import bisect
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from afd_sdk.errors import AFDConfigError

__all__ = [
    "DISPATCH_MODES",
    "PROFILE_ENGINES",
    "PROFILE_VERSION",
    "Curve",
    "DecodeCosts",
    "Host",
    "Profile",
    "routed_fraction",
]

PROFILE_VERSION = 1
#: how tokens reach FFN ranks: ``fan_in`` (each attention rank's whole batch to its FFN rank, A >= F) or
#: ``routed`` (each token to the FFN ranks holding its top-k experts: CAM-style dispatch)
DISPATCH_MODES = ("fan_in", "routed")
#: where a profile's compute was measured (``afd plan calibrate --engine``)
PROFILE_ENGINES = ("reference", "vllm")


def routed_fraction(num_experts: int, top_k: int, ffn_ranks: int) -> float:
    """Probability that a token routed to ``top_k`` of ``num_experts`` experts, spread evenly over ``ffn_ranks``,
    needs a given FFN rank: ``1 - C(E - E/F, k) / C(E, k)`` (as aiconfigurator states it)."""
    if ffn_ranks <= 1:
        return 1.0
    if num_experts % ffn_ranks:
        raise AFDConfigError(
            f"ffn={ffn_ranks} with {num_experts} experts; expected a number of FFN ranks that divides the experts",
            key="ffn",
        )
    elsewhere = num_experts - num_experts // ffn_ranks
    return 1.0 - math.comb(elsewhere, top_k) / math.comb(num_experts, top_k)


@dataclass(frozen=True)
class Curve:
    """Measured ``(x, microseconds)`` points, ``x`` ascending (tokens or bytes)."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        xs = [p[0] for p in self.points]
        if not self.points or xs != sorted(xs) or len(set(xs)) != len(xs) or xs[0] <= 0:
            raise AFDConfigError(
                f"curve points {list(self.points)!r}; expected at least one (x, us) pair, x > 0 strictly ascending",
                key="points",
            )

    def __call__(self, x: float) -> float:
        pts = self.points
        if len(pts) == 1:
            return pts[0][1] * x / pts[0][0]
        xs = [p[0] for p in pts]
        i = min(max(bisect.bisect_left(xs, x), 1), len(pts) - 1)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        # a falling segment (noise between two medians) is flat beyond the last point: costs never fall with size
        slope = (y1 - y0) / (x1 - x0) if x <= x1 else max((y1 - y0) / (x1 - x0), 0.0)
        y = y0 + slope * (x - x0)
        if x < x0:  # below the first point: never less than proportional scaling of it
            y = max(y, y0 * x / x0)
        return max(y, 0.0)

    def as_list(self) -> list[list[float]]:
        return [list(p) for p in self.points]

    @classmethod
    def from_list(cls, raw: Sequence[Sequence[float]], key: str) -> Curve:
        try:
            return cls(tuple((float(x), float(y)) for x, y in raw))
        except (TypeError, ValueError) as exc:
            raise AFDConfigError(f"{key}={raw!r}; expected a list of [x, microseconds] pairs", key=key) from exc
        except AFDConfigError as exc:
            raise AFDConfigError(f"{key}: {exc}", key=key) from None


@dataclass(frozen=True)
class Host:
    """Where a profile was measured: the model shares these cores among the deployment's processes."""

    cores: int
    threads_per_process: int = 1
    #: how much slower each of ``cores`` processes computing at once runs than one alone (measured; 1.0 ideal)
    concurrency_slowdown: float = 1.0

    @classmethod
    def here(cls, threads_per_process: int = 1, concurrency_slowdown: float = 1.0) -> Host:
        return cls(len(os.sched_getaffinity(0)), threads_per_process, concurrency_slowdown)

    def check(self) -> None:
        for key, value, least in (
            ("host.cores", self.cores, 1),
            ("host.threads_per_process", self.threads_per_process, 1),
            ("host.concurrency_slowdown", self.concurrency_slowdown, 1.0),
        ):
            if not value >= least:
                raise AFDConfigError(f"{key}={value!r}; expected a number >= {least}", key=key, value=value)

    @property
    def slots(self) -> float:
        """Processes that compute at full share at once: cores over threads per process."""
        return max(self.cores / self.threads_per_process, 1.0)

    def slowdown(self, busy: int) -> float:
        """The factor for ``busy`` processes computing at once (``busy <= slots``), linear from 1 alone to the
        measured slowdown with every core busy."""
        if self.slots <= 1 or busy <= 1:
            return 1.0
        return 1.0 + (self.concurrency_slowdown - 1.0) * (min(busy, self.slots) - 1) / (self.slots - 1)


@dataclass(frozen=True)
class DecodeCosts:
    """Decode steps as calibration measured them: one new token per request, attending over a KV cache.

    ``attention_us[context]`` is the attention per layer vs the tokens of a micro-batch (one per request) when
    every request's cache holds ``context`` tokens; ``ffn_us`` the FFN per layer vs tokens on decode steps'
    hidden states (one row per request: an MoE layer's cost follows the distinct experts its rows hit, more for
    independent requests than for as many tokens of one prompt). ``step_overhead_us`` is a decode step's excess
    over the model of its layers, the mean over two measured 1A1F decode steps of different batches (embedding,
    LM head, sampling, the runner's bookkeeping, and the layers running slower in a real step's alternating
    processes than in the microbenchmark; on a shared host one world alone is too noisy to carry it).
    """

    attention_us: Mapping[int, Curve]
    ffn_us: Curve
    step_overhead_us: float

    def __post_init__(self) -> None:
        contexts = list(self.attention_us)
        if not contexts or min(contexts) < 1:
            raise AFDConfigError(
                f"decode.attention_us contexts {contexts!r}; expected at least one context >= 1", key="decode"
            )
        xs = {tuple(x for x, _ in c.points) for c in self.attention_us.values()}
        if len(xs) != 1:
            raise AFDConfigError(
                "decode.attention_us: the contexts' curves cover different token counts; expected the same points "
                "at every context (as afd plan calibrate measures them)",
                key="decode",
            )

    @property
    def contexts(self) -> list[int]:
        return sorted(self.attention_us)

    def attention_at(self, context: int) -> Curve:
        """The attention curve at ``context``: at each token count, the measured contexts' costs as a
        :class:`Curve` over context (linear between them; beyond the last, its last segment's slope; one context
        alone scales in proportion)."""
        contexts = self.contexts
        tokens = [x for x, _ in self.attention_us[contexts[0]].points]
        points = []
        for i, x in enumerate(tokens):
            over_context = Curve(tuple((float(c), self.attention_us[c].points[i][1]) for c in contexts))
            points.append((x, over_context(context)))
        return Curve(tuple(points))

    def as_dict(self) -> dict[str, Any]:
        return {
            "attention_us": {str(c): self.attention_us[c].as_list() for c in self.contexts},
            "ffn_us": self.ffn_us.as_list(),
            "step_overhead_us": self.step_overhead_us,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DecodeCosts:
        try:
            curves = {int(c): Curve.from_list(v, f"decode.attention_us.{c}") for c, v in raw["attention_us"].items()}
        except (TypeError, ValueError, AttributeError) as exc:
            raise AFDConfigError(
                f"decode.attention_us holds {raw.get('attention_us')!r} ({exc}); expected {{context: [[tokens, us], "
                "...]}}",
                key="decode.attention_us",
            ) from None
        try:
            return cls(curves, Curve.from_list(raw["ffn_us"], "decode.ffn_us"), float(raw["step_overhead_us"]))
        except KeyError as exc:
            raise AFDConfigError(
                f"profile has no 'decode.{exc.args[0]}'; re-run afd plan calibrate --context", key="decode"
            ) from None


@dataclass(frozen=True)
class Profile:
    """One architecture over one connector on one host, as :func:`afd_sdk.plan.calibrate.calibrate` measured it.

    ``attention_us`` and ``ffn_us`` are per decoder layer as functions of the tokens one call processes (the
    FFN's over the tokens of all attention ranks it batches); ``round_trip_us`` is one exchange (hidden states
    there and back) as a function of the bytes sent one way; ``step_overhead_us`` is what measured 1A1F
    split steps cost beyond the model of their layers (embedding, LM head, sampling, the runner's bookkeeping):
    the smaller excess of the smallest and the middle batch's worlds.
    """

    arch: str
    connector: str
    dispatch: str
    hidden_size: int
    num_layers: int
    bytes_per_element: int
    tokens_per_request: int
    num_experts: int
    top_k: int
    attention_us: Curve
    ffn_us: Curve
    round_trip_us: Curve
    step_overhead_us: float
    host: Host
    measured: Mapping[str, Any] = field(default_factory=dict)
    #: decode steps at measured KV-cache contexts (``afd plan calibrate --context``); ``None``: not calibrated
    decode: DecodeCosts | None = None
    #: whose kernels the compute curves and step overheads are: ``reference`` (transformers) or ``vllm``
    engine: str = "reference"

    def __post_init__(self) -> None:
        self.host.check()
        if self.dispatch not in DISPATCH_MODES:
            raise AFDConfigError(
                f"dispatch={self.dispatch!r}; expected one of {', '.join(DISPATCH_MODES)}", key="dispatch"
            )
        if self.engine not in PROFILE_ENGINES:
            raise AFDConfigError(
                f"engine={self.engine!r}; expected one of {', '.join(PROFILE_ENGINES)}", key="engine", value=self.engine
            )
        for key in ("hidden_size", "num_layers", "bytes_per_element", "tokens_per_request"):
            if int(getattr(self, key)) < 1:
                raise AFDConfigError(f"{key}={getattr(self, key)!r}; expected an int >= 1", key=key)
        if self.num_experts < 0 or self.top_k < 0 or self.top_k > max(self.num_experts, 0):
            raise AFDConfigError(
                f"top_k={self.top_k}, num_experts={self.num_experts}; expected 0 <= top_k <= num_experts", key="top_k"
            )

    def layer_attention_us(self, tokens: int) -> float:
        """One attention rank's work per layer on a micro-batch of ``tokens``."""
        return self.attention_us(tokens)

    def at_context(self, context: int) -> Profile:
        """This profile for decode steps over a KV cache of ``context`` tokens: one token per request, the
        decode attention curve at that context (:meth:`DecodeCosts.attention_at`), the decode FFN curve and the
        decode step's overhead; round trip and host are the same (bytes and cores, not context)."""
        if self.decode is None:
            raise AFDConfigError(
                f"context={context}: this profile has no decode curves; expected a profile from "
                "afd plan calibrate --context C[,C...]",
                key="context",
                value=context,
            )
        if context < 1:
            raise AFDConfigError(f"context={context}; expected an int >= 1", key="context", value=context)
        return replace(
            self,
            tokens_per_request=1,
            attention_us=self.decode.attention_at(context),
            ffn_us=self.decode.ffn_us,
            step_overhead_us=self.decode.step_overhead_us,
            decode=None,
        )

    def layer_ffn_us(self, attention: int, ffn: int, group: int, tokens: int) -> float:
        """An FFN rank's work per layer and micro-batch: fan-in batches its ``group`` of attention ranks'
        ``tokens`` each; routed does ``1/F`` of all ranks' expert work (uniform routing)."""
        if self.dispatch == "fan_in":
            return self.ffn_us(group * tokens)
        return self.ffn_us(attention * tokens / ffn)

    def layer_round_trip_us(self, attention: int, ffn: int, tokens: int) -> float:
        """One message's round trip: ``tokens`` hidden states (routed: the :func:`routed_fraction` of them)."""
        msg_bytes = tokens * self.hidden_size * self.bytes_per_element
        if self.dispatch == "routed":
            msg_bytes *= routed_fraction(self.num_experts, self.top_k, ffn)
        return self.round_trip_us(msg_bytes)

    def extra_message_us(self, round_trip_us: float) -> float:
        """Half a round trip: an extra message's receive and send run on the FFN rank's own cores."""
        return round_trip_us / 2

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION,
            "arch": self.arch,
            "connector": self.connector,
            "engine": self.engine,
            "dispatch": self.dispatch,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "bytes_per_element": self.bytes_per_element,
            "tokens_per_request": self.tokens_per_request,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "attention_us": self.attention_us.as_list(),
            "ffn_us": self.ffn_us.as_list(),
            "round_trip_us": self.round_trip_us.as_list(),
            "step_overhead_us": self.step_overhead_us,
            "host": {
                "cores": self.host.cores,
                "threads_per_process": self.host.threads_per_process,
                "concurrency_slowdown": self.host.concurrency_slowdown,
            },
            "measured": dict(self.measured),
            **({"decode": self.decode.as_dict()} if self.decode is not None else {}),
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Profile:
        if raw.get("version") != PROFILE_VERSION:
            raise AFDConfigError(
                f"version={raw.get('version')!r}; expected {PROFILE_VERSION} (re-run afd plan calibrate)", key="version"
            )
        try:
            host = raw["host"]
            return cls(
                arch=str(raw["arch"]),
                connector=str(raw["connector"]),
                engine=str(raw.get("engine", "reference")),
                dispatch=str(raw["dispatch"]),
                hidden_size=int(raw["hidden_size"]),
                num_layers=int(raw["num_layers"]),
                bytes_per_element=int(raw["bytes_per_element"]),
                tokens_per_request=int(raw["tokens_per_request"]),
                num_experts=int(raw["num_experts"]),
                top_k=int(raw["top_k"]),
                attention_us=Curve.from_list(raw["attention_us"], "attention_us"),
                ffn_us=Curve.from_list(raw["ffn_us"], "ffn_us"),
                round_trip_us=Curve.from_list(raw["round_trip_us"], "round_trip_us"),
                step_overhead_us=float(raw["step_overhead_us"]),
                host=Host(
                    cores=int(host["cores"]),
                    threads_per_process=int(host.get("threads_per_process", 1)),
                    concurrency_slowdown=float(host.get("concurrency_slowdown", 1.0)),
                ),
                measured=dict(raw.get("measured", {})),
                decode=DecodeCosts.from_dict(raw["decode"]) if raw.get("decode") is not None else None,
            )
        except KeyError as exc:
            key = str(exc.args[0])
            raise AFDConfigError(f"profile has no {key!r}; re-run afd plan calibrate", key=key) from None
        except AFDConfigError:
            raise  # already names its key
        except (TypeError, ValueError, AttributeError) as exc:
            raise AFDConfigError(
                f"profile holds a value of the wrong type ({exc}); expected afd plan calibrate's JSON", key="profile"
            ) from None

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.as_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        return cls.from_dict(read_json(path, "profile"))


def read_json(path: str | os.PathLike[str], key: str) -> Any:
    """A planner input file's JSON; an unreadable file is an :class:`AFDConfigError` naming ``key``."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise AFDConfigError(f"{key}={str(path)!r} cannot be read as JSON: {exc}", key=key) from None
