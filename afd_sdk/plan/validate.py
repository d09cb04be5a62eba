"""``afd plan validate``: run the measured sweep and put the model's prediction beside each measurement.

Every configuration is a real AFD world on a checkpoint with the profile's architecture, layers and tokens per
request, over the profile's connector, one after the other: the reference runtime's
(:func:`afd_sdk.plan.sweep.measure_step`), or for a profile calibrated with ``--engine vllm`` vLLM engines
(:func:`afd_sdk.plan.vllm_sweep.measure_vllm_step`, one micro-batch stage). With a ``context``, decode steps over
prompts of that length against the profile's decode curves at that context.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from afd_sdk.errors import AFDConfigError
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
    calibration fits its overheads to the fastest runs alike."""
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
    steps: dict[int, list[float]] = {i: [] for i in range(len(deployments))}
    with tempfile.TemporaryDirectory(prefix="afd-plan-validate-") as model_dir:
        save_bench_checkpoint(profile.arch, config, model_dir)
        # rounds take turns over the deployments: a slow spell of a shared host reaches one run of each, and the
        # fastest run of each leaves it out
        runs = [i for _ in range(rounds) for i in range(len(deployments))]
        for n, i in enumerate(runs):
            if on_progress is not None:
                on_progress(deployments[i], n, len(runs))
            got = measure(
                deployments[i],
                connector=profile.connector,
                model_dir=model_dir,
                vocab_size=int(config.vocab_size),
                tokens_per_request=profile.tokens_per_request,
                repeat=repeat,
                context=context,
            )
            steps[i].append(got["step_ms"])
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
                "bottleneck": pred.bottleneck,
                "predicted_tokens_per_s_per_rank": pred.tokens_per_s_per_rank,
                "measured_tokens_per_s_per_rank": tokens / (measured_ms / 1000) / (dep.attention + dep.ffn),
            }
        )
    errors = [abs(r["error"]) for r in rows]
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
    }
