"""``afd plan validate``: run the measured sweep and put the model's prediction beside each measurement.

Every configuration is a real AFD world on a checkpoint with the profile's architecture, layers and tokens per
request, over the profile's connector, one after the other: the reference runtime's
(:func:`afd_sdk.plan.sweep.measure_step`), or for a profile calibrated with ``--engine vllm`` vLLM engines
(:func:`afd_sdk.plan.vllm_sweep.measure_vllm_step`, one micro-batch stage). With a ``context``, decode steps over
prompts of that length against the profile's decode curves at that context.

A shared host's speed drifts between calibration and validation (the same world measured minutes apart has moved by
40 % on the 2-core CI machine), and every prediction inherits calibration's speed. So each round also runs the
1A1F worlds calibration fitted the step overhead of the kind validated to (prefill, or decode at calibration's
shortest context; the
*anchors*, :func:`~afd_sdk.plan.calibrate.fitted_worlds`; a validated row's runs serve where it is the same
world), and the report gives the host's drift (the geometric
mean over the anchors of the fastest run now over then) and each error with the predictions scaled by it
(``drift_corrected_error``). The ratio is measurement over measurement of the same worlds: the model plays no part.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from afd_sdk.errors import AFDConfigError
from afd_sdk.plan.calibrate import fitted_worlds
from afd_sdk.plan.model import Deployment, plan
from afd_sdk.plan.profile import Profile
from afd_sdk.plan.sweep import check_decode_contexts, measure_step

__all__ = ["validate"]


def validate(
    profile: Profile,
    deployments: Sequence[Deployment],
    *,
    repeat: int = 10,
    rounds: int = 1,
    on_progress: Callable[[Deployment, int, int], None] | None = None,
    context: int | None = None,
) -> dict[str, Any]:
    """Measure each deployment and compare. Returns rows (predicted and measured ms, signed error as a fraction
    of the measurement), the median and worst absolute error, the worst absolute error of the best constant
    prediction over the same measurements (``constant_worst_abs_error``), the predicted and measured best (tokens/s
    per rank) and how far the predicted best falls short of the measured best. ``context``: decode steps over a
    KV cache of that many tokens (the profile needs decode curves: ``afd plan calibrate --context``). ``rounds``:
    each deployment runs that many times, the rounds taking turns over the deployments; a row's measurement is
    the fastest run's (``measured_runs_ms`` each run's): slow spells of a shared host only add time, and
    calibration fits its overheads to the fastest runs alike. ``host_drift`` (``None`` for a profile without a
    fitted step-overhead world): ``worlds``, one entry per anchor with its runs (timed with ``repeat`` as the rows
    are; a validated row's runs where it is the same world) and its own ``ratio`` (fastest run now over
    calibration's), and ``ratio``, the geometric mean of those. Each row's ``drift_corrected_error`` and the
    ``drift_corrected_median_abs_error`` / ``drift_corrected_worst_abs_error`` are the errors of the predictions
    times that mean. ``on_progress`` counts the anchors' runs too."""
    if repeat < 1:
        raise AFDConfigError(f"repeat={repeat}; expected an int >= 1", key="repeat", value=repeat)
    if rounds < 1:
        raise AFDConfigError(f"rounds={rounds}; expected an int >= 1", key="rounds", value=rounds)
    if not deployments:
        raise AFDConfigError("no deployment to validate; widen --attention/--ffn/--stages/--batch", key="attention")
    costs = profile.at_context(context) if context is not None else profile
    for dep in deployments:
        dep.check(profile.dispatch, profile.num_experts)
        if profile.engine == "vllm" and dep.stages != 1:
            raise AFDConfigError(
                f"stages={dep.stages} ({dep.label}) with a vLLM-engine profile; expected 1: the AFD attention role "
                "inside vLLM runs no micro-batch overlap (--stages 1)",
                key="stages",
                value=dep.stages,
            )
    measure = measure_step
    if profile.engine == "vllm":
        from afd_sdk.plan.vllm_sweep import measure_vllm_step as measure
        from afd_sdk.plan.vllm_sweep import require_vllm

        require_vllm("afd plan validate")
    from afd_sdk.bench.pipeline_bench import bench_config, save_bench_checkpoint

    config = bench_config(profile.arch, profile.num_layers)
    if context is not None:
        check_decode_contexts([context], repeat, int(config.max_position_embeddings))
    preds, _ = plan(costs, deployments)
    # calibration's 1A1F worlds of the kind validated, each at its own context: a validated row's runs where one
    # is the same world, else after the rows (and first in each round)
    anchors = fitted_worlds(profile, decode=context is not None)
    worlds = [(dep, context) for dep in deployments]
    for dep, at, _ in anchors:
        if (dep, at) not in worlds:
            worlds.append((dep, at))
    for dep, at, _ in anchors:
        try:
            check_decode_contexts([at] if at else [], repeat, int(config.max_position_embeddings))
        except AFDConfigError:
            raise AFDConfigError(
                f"repeat={repeat}: calibration's decode world {dep.label} at context {at}, which validate runs to "
                "measure the host's drift, would decode past the bench model's positions; expected a smaller --repeat",
                key="repeat",
                value=repeat,
            ) from None
    steps: dict[int, list[float]] = {i: [] for i in range(len(worlds))}
    with tempfile.TemporaryDirectory(prefix="afd-plan-validate-") as model_dir:
        save_bench_checkpoint(profile.arch, config, model_dir)
        # rounds take turns over the worlds: a slow spell of a shared host reaches one run of each, and the
        # fastest run of each leaves it out
        order = [*range(len(deployments), len(worlds)), *range(len(deployments))]
        runs = [i for _ in range(rounds) for i in order]
        for n, i in enumerate(runs):
            dep, at = worlds[i]
            if on_progress is not None:
                on_progress(dep, n, len(runs))
            got = measure(
                dep,
                connector=profile.connector,
                model_dir=model_dir,
                vocab_size=int(config.vocab_size),
                tokens_per_request=profile.tokens_per_request,
                repeat=repeat,
                context=at,
            )
            steps[i].append(got["step_ms"])
    drift = None
    if anchors:
        seen = []
        for dep, at, then_ms in anchors:
            k = worlds.index((dep, at))
            now_ms = min(steps[k])
            seen.append(
                {
                    "deployment": dep.label,
                    "context": at,
                    "calibrated_ms": then_ms,
                    "measured_ms": now_ms,
                    "measured_runs_ms": steps[k],
                    "ratio": now_ms / then_ms,
                }
            )
        # the geometric mean: one world's slow spell moves it by that world's share, not all of it
        drift = {"ratio": statistics.geometric_mean(w["ratio"] for w in seen), "worlds": seen}
    rows = []
    for i, (dep, pred) in enumerate(zip(deployments, preds, strict=True)):
        measured_ms = min(steps[i])
        tokens = dep.attention * dep.batch * costs.tokens_per_request
        rows.append(
            {
                "label": dep.label,
                "attention": dep.attention,
                "ffn": dep.ffn,
                "stages": dep.stages,
                "batch": dep.batch,
                "predicted_ms": pred.step_ms,
                "measured_ms": measured_ms,
                "measured_runs_ms": steps[i],
                "error": (pred.step_ms - measured_ms) / measured_ms,
                "drift_corrected_error": (pred.step_ms * drift["ratio"] - measured_ms) / measured_ms if drift else None,
                "bottleneck": pred.bottleneck,
                "predicted_tokens_per_s_per_rank": pred.tokens_per_s_per_rank,
                "measured_tokens_per_s_per_rank": tokens / (measured_ms / 1000) / (dep.attention + dep.ffn),
            }
        )
    errors = [abs(r["error"]) for r in rows]
    corrected = [abs(r["drift_corrected_error"]) for r in rows if drift]
    lo, hi = min(r["measured_ms"] for r in rows), max(r["measured_ms"] for r in rows)
    predicted_best = max(rows, key=lambda r: r["predicted_tokens_per_s_per_rank"])
    measured_best = max(rows, key=lambda r: r["measured_tokens_per_s_per_rank"])
    shortfall = 1 - predicted_best["measured_tokens_per_s_per_rank"] / measured_best["measured_tokens_per_s_per_rank"]
    return {
        "arch": profile.arch,
        "connector": profile.connector,
        "dispatch": profile.dispatch,
        "context": context,
        "rows": rows,
        "median_abs_error": statistics.median(errors),
        "worst_abs_error": max(errors),
        # the best any constant prediction can do over these measurements (c = 2·lo·hi/(lo+hi) is off by this at
        # both ends): a model whose worst error is not below it tells the configurations apart no better
        "constant_worst_abs_error": (hi - lo) / (hi + lo),
        "predicted_best": predicted_best["label"],
        "measured_best": measured_best["label"],
        "best_shortfall": shortfall,
        "host_drift": drift,
        "drift_corrected_median_abs_error": statistics.median(corrected) if corrected else None,
        "drift_corrected_worst_abs_error": max(corrected) if corrected else None,
    }
