"""``afd plan``: predict every A:F / stages / batch configuration; ``calibrate``, ``validate``, ``paper``."""

from __future__ import annotations

import json
import time
from typing import Any

import click

from afd_sdk.cli.output import console, echo_json, require_matplotlib
from afd_sdk.errors import AFDConfigError

__all__ = ["attach"]


def _int_range(text: str, key: str) -> list[int]:
    """``"1-4"``, ``"1,2,4"`` or ``"2"`` as a sorted list of ints in 1..4096."""
    out: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if not 1 <= first <= last <= 4096:
                raise ValueError(part)
            out.update(range(first, last + 1))
    except ValueError:
        raise AFDConfigError(
            f"--{key} {text!r}; expected a rising range '1-4', a list '1,2,4' or one int, each in 1..4096",
            key=key,
            value=text,
        ) from None
    return sorted(out)


def _int_list(text: str, key: str) -> list[int]:
    """``"128,512"`` as a sorted list of distinct ints >= 1 (no ranges: every int of one would be measured)."""
    try:
        out = sorted({int(part) for part in text.split(",")})
        if out[0] < 1:
            raise ValueError(text)
    except ValueError:
        raise AFDConfigError(
            f"--{key} {text!r}; expected a list of KV-cache lengths '128,512' (ints >= 1)", key=key, value=text
        ) from None
    return out


def _stderr_progress(prefix: str, eta: bool = False) -> Any:
    """Progress lines on stderr: ``[done/total] what (elapsed)``; with ``eta`` (steps of about equal length, each
    announced as it starts) also the time left at the mean pace of the steps finished so far."""
    t0 = time.monotonic()

    def show(what: str, done: int, total: int) -> None:
        elapsed = time.monotonic() - t0
        finished = done - 1
        left = f", about {elapsed / finished * (total - finished):.0f}s left" if eta and finished > 0 else ""
        click.echo(f"{prefix} [{done}/{total}] {what} ({elapsed:.0f}s{left})", err=True)

    return show


def _costs(profile: str | None, hardware: str | None) -> Any:
    from afd_sdk.plan.hardware import HardwareSpec
    from afd_sdk.plan.profile import Profile

    if (profile is None) == (hardware is None):
        raise AFDConfigError("give one of --profile (calibrated here) or --hardware (a spec file)", key="profile")
    return Profile.load(profile) if profile else HardwareSpec.load(hardware)  # type: ignore[arg-type]


@click.group("plan", invoke_without_command=True)
@click.option("--profile", type=click.Path(dir_okay=False), help="A profile from `afd plan calibrate`.")
@click.option("--hardware", type=click.Path(dir_okay=False), help="A hardware spec file (docs/planning.md).")
@click.option("--attention", default="1-4", show_default=True, help="Attention ranks: a range or a list.")
@click.option("--ffn", default="1-2", show_default=True, help="FFN ranks: a range or a list.")
@click.option("--stages", default="1-3", show_default=True, help="Micro-batch stages: a range or a list.")
@click.option("--batch", default="4", show_default=True, help="Requests per attention rank per step.")
@click.option("--tpot-ms", type=click.FloatRange(min=0, min_open=True), help="Step (time per output token) bound.")
@click.option(
    "--context",
    type=click.IntRange(min=1),
    help="Decode steps over a KV cache of this many tokens (a profile calibrated with --context; a spec's "
    "model.context_tokens).",
)
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a PNG: step time vs tokens/s per rank.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def plan_group(
    ctx: click.Context,
    profile: str | None,
    hardware: str | None,
    attention: str,
    ffn: str,
    stages: str,
    batch: str,
    tpot_ms: float | None,
    context: int | None,
    plot: str | None,
    as_json: bool,
) -> None:
    """Predict step time, tokens/s, utilisation and bottleneck of every configuration; name the best.

    The best has the highest tokens/s per rank (each rank one device) among those whose step meets --tpot-ms.
    """
    if ctx.invoked_subcommand is not None:
        return
    from afd_sdk.plan.model import deployments, plan

    if plot:
        require_matplotlib()
    costs = _costs(profile, hardware)
    if context is not None:
        costs = costs.at_context(context)
    cands = deployments(
        _int_range(attention, "attention"),
        _int_range(ffn, "ffn"),
        _int_range(stages, "stages"),
        _int_range(batch, "batch"),
        costs.dispatch,
        costs.num_experts,
    )
    if not cands:
        raise AFDConfigError(
            f"no valid configuration in --attention {attention} --ffn {ffn} (dispatch {costs.dispatch}: "
            "fan-in needs attention >= ffn) --stages {stages} --batch {batch} (stages <= batch)",
            key="attention",
        )
    preds, best = plan(costs, cands, tpot_ms=tpot_ms)
    if plot:
        _plot(preds, best, plot)
    if as_json:
        echo_json(
            {
                "dispatch": costs.dispatch,
                "context": context,
                "tpot_ms": tpot_ms,
                "predictions": [p.as_dict() for p in preds],
                "best": best.as_dict() if best else None,
            }
        )
        return
    from rich.table import Table

    shape = f"decode over {context} tokens of context" if context else f"{costs.tokens_per_request} tokens per request"
    table = Table(title=f"predicted ({costs.dispatch} dispatch, {shape})")
    for col in ("A", "F", "S", "batch", "step ms", "tokens/s", "tokens/s/rank", "attn util", "ffn util", "bottleneck"):
        table.add_column(col, justify="right")
    for p in preds:
        d = p.deployment
        mark = " *" if p is best else ""
        table.add_row(
            str(d.attention),
            str(d.ffn),
            str(d.stages),
            str(d.batch),
            f"{p.step_ms:.2f}",
            f"{p.tokens_per_s:,.0f}",
            f"{p.tokens_per_s_per_rank:,.0f}{mark}",
            f"{p.attention_utilisation:.0%}",
            f"{p.ffn_utilisation:.0%}",
            p.bottleneck,
        )
    console().print(table)
    if best is None:
        click.echo(f"no configuration meets --tpot-ms {tpot_ms:g}", err=True)
    else:
        click.echo(f"best: {best.deployment.label} ({best.tokens_per_s_per_rank:,.0f} tokens/s per rank)")


def _plot(preds: list[Any], best: Any, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([p.step_ms for p in preds], [p.tokens_per_s_per_rank for p in preds], s=18)
    for p in preds:
        ax.annotate(p.deployment.label, (p.step_ms, p.tokens_per_s_per_rank), fontsize=6)
    if best is not None:
        ax.scatter([best.step_ms], [best.tokens_per_s_per_rank], s=80, facecolors="none", edgecolors="r")
    ax.set_xlabel("predicted step (ms)")
    ax.set_ylabel("predicted tokens/s per rank")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@plan_group.command("calibrate")
@click.option("--arch", default="Qwen3MoeForCausalLM", show_default=True, help="Architecture (a bench config).")
@click.option(
    "--connector",
    default="zmq",
    show_default=True,
    help="zmq, p2p, shm, nixl (fan-in) or cam (routed, gate on Attention).",
)
@click.option(
    "--engine",
    default="reference",
    show_default=True,
    help="Whose kernels to measure: reference (transformers) or vllm (in-process engine; needs .venv-vllm).",
)
@click.option("--layers", type=click.IntRange(1, 96), default=8, show_default=True)
@click.option("--tokens", type=click.IntRange(1, 4096), default=16, show_default=True, help="Tokens per request.")
@click.option("--batch", default="1,2,4,8", show_default=True, help="Per-rank batches the curves cover.")
@click.option("--max-group", type=click.IntRange(1, 16), default=3, show_default=True, help="Most ranks per FFN.")
@click.option(
    "--world-rounds",
    type=click.IntRange(1, 20),
    default=3,
    show_default=True,
    help="Runs of each real split world the overheads are fitted to (in turns; the fastest counts).",
)
@click.option(
    "--context",
    "contexts",
    help="Also calibrate decode: KV-cache lengths (a list '128,512'), one new token per request.",
)
@click.option("--out", type=click.Path(dir_okay=False), required=True, help="Where to write the profile (JSON).")
@click.option("--json", "as_json", is_flag=True)
def plan_calibrate(
    arch: str,
    connector: str,
    engine: str,
    layers: int,
    tokens: int,
    batch: str,
    max_group: int,
    world_rounds: int,
    contexts: str | None,
    out: str,
    as_json: bool,
) -> None:
    """Measure attention and FFN time per layer, the connector's round trip and the step overhead here."""
    from afd_sdk.plan.calibrate import calibrate

    profile = calibrate(
        arch=arch,
        connector=connector,
        engine=engine,
        layers=layers,
        tokens_per_request=tokens,
        requests=_int_range(batch, "batch"),
        max_group=max_group,
        world_rounds=world_rounds,
        contexts=_int_list(contexts, "context") if contexts else (),
        on_progress=_stderr_progress("calibrate"),
    )
    profile.save(out)
    if as_json:
        echo_json(profile.as_dict())
        return
    head = f"wrote {out}: {arch} over {connector} ({profile.dispatch}, {engine}), {profile.host.cores} cores"
    click.echo(
        f"{head}; 1A1F step measured vs modelled: {_worlds(profile.measured, decode=False)} -> step overhead "
        f"{profile.step_overhead_us / 1000:.1f} ms (the smaller excess)"
    )
    if profile.decode is not None:
        shown = _worlds(profile.measured, decode=True)
        click.echo(
            f"decode at contexts {profile.decode.contexts}: 1A1F decode steps measured vs modelled: {shown} -> "
            f"decode step overhead {profile.decode.step_overhead_us / 1000:.1f} ms (their mean excess)"
        )


def _worlds(measured: dict[str, Any], decode: bool) -> str:
    """Calibration's 1A1F overhead worlds, measured vs modelled, in batch order."""
    from afd_sdk.plan.calibrate import overhead_worlds

    return ", ".join(
        f"{w['deployment']} {w['measured_ms']:.1f} vs {w['modelled_ms']:.1f} ms"
        for w in overhead_worlds(measured, decode)
    )


@plan_group.command("validate")
@click.option("--profile", type=click.Path(dir_okay=False), required=True)
@click.option("--attention", default="1-3", show_default=True)
@click.option("--ffn", default="1-2", show_default=True)
@click.option(
    "--stages",
    help="Micro-batch stages [default: 1-2; 1 for a vLLM-engine profile: AFD inside vLLM runs no micro-batch overlap]",
)
@click.option("--batch", default="8", show_default=True)
@click.option("--repeat", type=click.IntRange(3, 1000), default=10, show_default=True, help="Timed steps per run.")
@click.option(
    "--rounds",
    type=click.IntRange(1, 20),
    default=1,
    show_default=True,
    help="Runs of each configuration, taking turns (the fastest counts): for a shared, noisy host.",
)
@click.option(
    "--context", type=click.IntRange(min=1), help="Decode steps over prompts of this many tokens (decode curves)."
)
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the result (JSON) here.")
@click.option("--json", "as_json", is_flag=True)
def plan_validate(
    profile: str,
    attention: str,
    ffn: str,
    stages: str | None,
    batch: str,
    repeat: int,
    rounds: int,
    context: int | None,
    out: str | None,
    as_json: bool,
) -> None:
    """Run every configuration for real and put the prediction beside the measurement."""
    from afd_sdk.plan.model import deployments
    from afd_sdk.plan.profile import Profile
    from afd_sdk.plan.validate import validate

    prof = Profile.load(profile)
    if stages is None:
        stages = "1" if prof.engine == "vllm" else "1-2"
    cands = deployments(
        _int_range(attention, "attention"),
        _int_range(ffn, "ffn"),
        _int_range(stages, "stages"),
        _int_range(batch, "batch"),
        prof.dispatch,
        prof.num_experts,
    )
    progress = _stderr_progress("validate", eta=True)  # every run is one world of the sweep
    r = validate(
        prof,
        cands,
        repeat=repeat,
        rounds=rounds,
        context=context,
        on_progress=lambda d, i, n: progress(d.label, i + 1, n),
    )
    if out:
        with open(out, "w") as fh:
            json.dump(r, fh, indent=2)
    if as_json:
        echo_json(r)
        return
    from rich.table import Table

    shape = f", decode over {context} tokens of context" if context else ""
    table = Table(title=f"{r['arch']} over {r['connector']}{shape}: predicted vs measured step")
    drift = r["host_drift"]
    cols = ["configuration", "predicted ms", "measured ms", "error"]
    for col in cols + (["error, drift-corrected"] if drift else []) + ["bottleneck"]:
        table.add_column(col, justify="right")
    for row in r["rows"]:
        cells = [row["label"], f"{row['predicted_ms']:.1f}", f"{row['measured_ms']:.1f}", f"{row['error']:+.1%}"]
        if drift:
            cells.append(f"{row['drift_corrected_error']:+.1%}")
        table.add_row(*cells, row["bottleneck"])
    console().print(table)
    click.echo(
        f"median |error| {r['median_abs_error']:.1%}, worst {r['worst_abs_error']:.1%} (the best constant: "
        f"{r['constant_worst_abs_error']:.1%}); best predicted "
        f"{r['predicted_best']}, measured {r['measured_best']} (shortfall {r['best_shortfall']:.1%})"
    )
    if drift:
        worlds = ", ".join(
            f"{w['deployment']}{_at_context(w['context'])} {w['measured_ms']:.1f} ms now, {w['calibrated_ms']:.1f} then"
            for w in drift["worlds"]
        )
        click.echo(
            f"host drift since calibration x{drift['ratio']:.2f} ({worlds}); the predictions scaled by it: median "
            f"|error| {r['drift_corrected_median_abs_error']:.1%}, worst {r['drift_corrected_worst_abs_error']:.1%}"
        )


def _at_context(context: int | None) -> str:
    return f" at context {context}" if context else ""


@plan_group.command("paper")
@click.option("--json", "as_json", is_flag=True)
def plan_paper(as_json: bool) -> None:
    """Published AFD figures recomputed by the planner from their stated inputs."""
    from afd_sdk.plan.published import reproduce

    rows = reproduce()
    if as_json:
        echo_json(rows)
        return
    from rich.table import Table

    table = Table(title="published figures vs the planner")
    for col in ("source", "figure", "published", "planner", "unit"):
        table.add_column(col)
    for row in rows:
        table.add_row(row["source"], row["figure"], f"{row['published']:g}", f"{row['planner']:.1f}", row["unit"])
    console().print(table)


def attach(cli: click.Group) -> None:
    cli.add_command(plan_group)
