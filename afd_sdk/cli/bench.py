"""``afd bench …`` commands: our code against the raw layer under it, in one run."""

from __future__ import annotations

import json
from typing import Any

import click

from afd_sdk.cli.output import require_matplotlib
from afd_sdk.errors import AFDConfigError


def _comma_list(text: str) -> tuple[str, ...]:
    """``"a, b,,c"`` -> ``("a", "b", "c")``: the options that take a comma list."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _fmt_size(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}K"


@click.group("bench")
def bench_group() -> None:
    """Benchmarks (never timed tests): connector vs. raw transport, in the same run."""


@bench_group.command("connector")
@click.option("--connector", required=True, help="Connector name or alias.")
@click.option("--sizes", default="8K,64K,512K,4M,32M", show_default=True, help="Payload sizes (multiples of 4K).")
@click.option(
    "--iters",
    default=200,
    show_default=True,
    type=click.IntRange(10, 100000),
    help="Round trips per size (fewer above 1M).",
)
@click.option(
    "--raw",
    "raw",
    default=None,
    help="Comma list of raw baselines: zmq, gloo, memcpy, plus the connector's own (shm for ShmAFDConnector).",
)
@click.option("--extra-config", default="{}", help="connector_extra_config as JSON.")
@click.option(
    "--metrics",
    is_flag=True,
    help="Also run the connector with metrics recording on (as --metrics-port does) and report what it costs.",
)
@click.option(
    "--profile",
    is_flag=True,
    help="Also break each round trip into its parts (per call, per thread, per function), connector and raw.",
)
@click.option("--json", "as_json", is_flag=True)
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Write a latency-vs-size PNG.")
def bench_connector(
    connector: str,
    sizes: str,
    iters: int,
    raw: str | None,
    extra_config: str,
    metrics: bool,
    profile: bool,
    as_json: bool,
    plot: str | None,
) -> None:
    """Round-trip latency and throughput of CONNECTOR vs. its raw transport."""
    from afd_sdk.bench.connector_bench import check_baselines, parse_size, run_benchmark
    from afd_sdk.plugins import get_plugin_manager

    size_list = [parse_size(s) for s in sizes.split(",") if s.strip()]
    baselines = None if raw is None else _comma_list(raw)
    check_baselines(get_plugin_manager().connector_class(connector), baselines)
    try:
        extra = json.loads(extra_config)
    except json.JSONDecodeError as exc:
        raise AFDConfigError(f"--extra-config is not JSON: {exc}", key="extra-config", value=extra_config) from None
    if plot is not None:
        require_matplotlib()
    if not as_json:
        click.echo(
            f"benchmarking {connector} at {', '.join(map(_fmt_size, size_list))} (2 processes, loopback)…", err=True
        )
    result = run_benchmark(
        connector, size_list, iters=iters, baselines=baselines, extra_config=extra, metrics=metrics, profile=profile
    )
    if plot is not None:
        _plot(result, plot)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    _print_table(result)
    if profile:
        _print_profile(result)


@bench_group.command("pipeline")
@click.option("--arch", default="Qwen3MoeForCausalLM", show_default=True)
@click.option("--connector", default="zmq", show_default=True)
@click.option(
    "--requests",
    type=click.IntRange(2, 64),
    default=4,
    show_default=True,
    help="Requests per step (split evenly over the 2 stages).",
)
@click.option("--tokens", type=click.IntRange(1, 1024), default=128, show_default=True, help="Tokens per request.")
@click.option("--repeat", type=click.IntRange(3, 1000), default=15, show_default=True, help="Timed steps per mode.")
@click.option(
    "--layers",
    type=click.IntRange(1, 96),
    default=None,
    help="Decoder layers of the random model [default: the bench config's, 12]. The pipeline fills and drains "
    "once per step and overlaps every layer between, so a shallow model understates the overlap.",
)
@click.option("--json", "as_json", is_flag=True)
def bench_pipeline(
    arch: str, connector: str, requests: int, tokens: int, repeat: int, layers: int | None, as_json: bool
) -> None:
    """Attention-only, FFN-only, 1-stage and 2-stage step times, overlap efficiency, SDK overhead."""
    from afd_sdk.bench.pipeline_bench import run_pipeline_benchmark

    if not as_json:
        click.echo(f"benchmarking the {arch} pipeline over {connector} (2 processes, modes taking turns)…", err=True)
    r = run_pipeline_benchmark(
        arch=arch, connector=connector, requests=requests, tokens=tokens, repeat=repeat, layers=layers
    )
    if as_json:
        click.echo(json.dumps(r, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{arch} over {connector}: {r['tokens_per_step']} tokens/step, {r['layers']} layers")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        (
            "attention only, T_attn, whole batch / 2 micro-batches (ms)",
            f"{r['t_attn_ms']:.2f} / {r['t_attn_micro_ms']:.2f}",
        ),
        ("FFN only, T_ffn, whole batch / 2 micro-batches (ms)", f"{r['t_ffn_ms']:.2f} / {r['t_ffn_micro_ms']:.2f}"),
        ("split step, 1 stage, T1 (ms)", f"{r['t1_ms']:.2f}"),
        ("split step, 2 stages, T2 (ms)", f"{r['t2_ms']:.2f}"),
        ("overlap efficiency (T1-T2)/(T1-max), micro-batched bound", f"{r['overlap_efficiency']:.2f}"),
        ("overlap efficiency, whole-batch bound", f"{r['overlap_efficiency_whole_batch']:.2f}"),
        (
            "FFN compute inside the run, 1 / 2 stages (ms)",
            f"{r['ffn_compute_ms_1_stage']:.2f} / {r['ffn_compute_ms_2_stages']:.2f}",
        ),
        ("overlap efficiency against the 2-stage run's FFN compute", f"{r['overlap_efficiency_in_run']:.2f}"),
        ("proxy + metadata per layer (µs)", f"{r['proxy_metadata_us_per_layer']:.1f}"),
        ("framing per message (µs)", f"{r['framing_us_per_message']:.1f}"),
        ("SDK overhead per layer (µs)", f"{r['sdk_overhead_us_per_layer']:.1f}"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    Console(highlight=False).print(table)


@bench_group.command("soak")
@click.option(
    "--connector",
    "connectors",
    default="zmq,p2p,shm",
    show_default=True,
    help="Comma list of point-to-point connectors, soaked one after the other.",
)
@click.option("--steps", type=click.IntRange(10, 10_000_000), default=10_000, show_default=True)
@click.option(
    "--warmup",
    type=click.IntRange(1, 100_000),
    default=200,
    show_default=True,
    help="Steps before the first memory/fd sample.",
)
@click.option("--stages", type=click.IntRange(1, 8), default=2, show_default=True, help="Micro-batches per step.")
@click.option("--arch", default="Qwen3MoeForCausalLM", show_default=True, help="Architecture of the tiny model.")
@click.option("--json", "as_json", is_flag=True)
def bench_soak(connectors: str, steps: int, warmup: int, stages: int, arch: str, as_json: bool) -> None:
    """Run STEPS steps of the real runtime per connector (metrics on); RSS, fds and threads must stay flat.

    Exit 1 when a process grew beyond the stated bound (a leak).
    """
    from afd_sdk.bench.soak_bench import run_soak

    names = list(_comma_list(connectors))

    def progress(name: str, event: dict[str, Any]) -> None:
        if event.get("event") == "step":
            click.echo(f"  {name}: {event['step']}/{event['of']} steps", err=True)

    if not as_json:
        click.echo(
            f"soaking {', '.join(names)}: {steps} steps each after {warmup} warm-up, {stages} stage(s)…", err=True
        )
    r = run_soak(names, steps=steps, warmup=warmup, stages=stages, arch=arch, on_progress=None if as_json else progress)
    if as_json:
        click.echo(json.dumps(r, indent=2))
    else:
        _print_soak(r)
    if not all(row[side]["flat"] for row in r["rows"] for side in ("attention", "ffn")):
        raise click.exceptions.Exit(1)


def _print_soak(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    mib = 1 << 20
    table = Table(title=f"soak: {r['arch']}, {r['stages']} stage(s), {r['requests']}×{r['tokens']} tokens per step")
    for col in ("connector", "steps", "p50/p99 ms", "role", "RSS MiB", "ΔRSS", "fds", "threads", "flat"):
        table.add_column(col, justify="left" if col in ("connector", "role") else "right")
    for row in r["rows"]:
        for side in ("attention", "ffn"):
            u = row[side]
            first = side == "attention"
            table.add_row(
                row["connector"].removesuffix("AFDConnector") if first else "",
                str(row["steps"]) if first else "",
                f"{row['step_ms']['p50']:.1f}/{row['step_ms']['p99']:.1f}" if first else "",
                side,
                f"{u['start']['rss_bytes'] / mib:.1f}→{u['end']['rss_bytes'] / mib:.1f}",
                f"{u['growth']['rss_bytes'] / mib:+.2f}",
                f"{u['start']['fds']}→{u['end']['fds']}",
                f"{u['start']['threads']}→{u['end']['threads']}",
                "yes" if u["flat"] else "[red]NO[/]",
                end_section=not first,
            )
    console = Console(highlight=False, width=max(100, Console().width))
    console.print(table)
    console.print(f"flat: RSS growth ≤ {r['rss_bound_bytes'] / mib:.0f} MiB, no fd or thread more")


def _print_table(result: dict[str, Any]) -> None:
    """One row per (size, transport): the connector first, then each raw baseline with ratio and Δ."""
    from rich.console import Console
    from rich.table import Table

    wire = f", wire {result['wire']}" if result.get("wire") else ""
    table = Table(title=f"{result['connector']} round trip (fp32, hidden {result['hidden']}{wire})")
    for name in ("size", "transport", "median µs", "p90 µs", "connector ÷ this", "connector − this µs", "GB/s"):
        table.add_column(name, justify="left" if name == "transport" else "right")
    for row in result["rows"]:
        c = row["connector"]
        size = _fmt_size(row["size"])
        table.add_row(size, "connector", f"{c['median_us']:.1f}", f"{c['p90_us']:.1f}", "", "", f"{c['gbps']:.2f}")
        f = row.get("connector_first_use")
        if f is not None:
            table.add_row("", "first use", f"{f['median_us']:.1f}", f"{f['p90_us']:.1f}", "", "", f"{f['gbps']:.2f}")
        if "metrics_delta_us" in row:
            m = row["connector+metrics"]
            table.add_row(
                "",
                "connector + metrics",
                f"{m['median_us']:.1f}",
                f"{m['p90_us']:.1f}",
                "",
                f"{row['metrics_delta_us']:+.1f} (metrics)",
                f"{m['gbps']:.2f}",
            )
        for b in result["baselines"]:
            r = row[b]
            table.add_row(
                "",
                f"raw {b}",
                f"{r['median_us']:.1f}",
                f"{r['p90_us']:.1f}",
                f"{row[f'ratio_{b}']:.2f}×",
                f"{row[f'delta_{b}_us']:+.1f}",
                f"{r['gbps']:.2f}",
                end_section=b == result["baselines"][-1],
            )
    console = Console(highlight=False)
    console.print(table)
    idle = result.get("ffn_idle_cpu_pct")
    if idle is not None:
        console.print(f"idle FFN rank: {idle:.2f}% of one core while waiting {result['idle_s']:g} s for a message")
    rec = result.get("recording_ns")
    if rec is not None:
        console.print(
            f"metrics recording per exchange: attention {rec['attention'] / 1000:.2f} µs, "
            f"FFN {rec['ffn'] / 1000:.2f} µs"
        )


#: (label, side, key) rows of the --profile table; a raw baseline has no per-call rows
_PROFILE_ROWS = (
    ("round trip, wall", "attention", "rt_us"),
    ("attention: send call, wall", "attention", "send_us"),
    ("attention: send call, on CPU", "attention", "send_cpu_us"),
    ("attention: recv call, wall (waits for FFN)", "attention", "recv_us"),
    ("attention: recv call, on CPU", "attention", "recv_cpu_us"),
    ("attention: calling thread CPU / round trip", "attention", "thread_cpu_us"),
    ("attention: other threads' CPU / round trip", "attention", "background_cpu_us"),
    ("attention: sleeps / preemptions per round trip", "attention", "switches"),
    ("FFN: recv call, wall (waits for attention)", "ffn", "recv_us"),
    ("FFN: recv call, on CPU", "ffn", "recv_cpu_us"),
    ("FFN: send call, on CPU", "ffn", "send_cpu_us"),
    ("FFN: calling thread CPU / message", "ffn", "thread_cpu_us"),
    ("FFN: other threads' CPU / message", "ffn", "background_cpu_us"),
    ("FFN: sleeps / preemptions per message", "ffn", "switches"),
)
_TOP_FUNCTIONS_SHOWN = 6


def _print_profile(result: dict[str, Any]) -> None:
    """One table per size: the parts of a round trip (µs), connector and each raw baseline side by side."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=max(110, Console().width))
    for row in result["rows"]:
        prof = row["profile"]
        names = sorted(prof, key=lambda n: n != "connector")  # the connector first, then each raw baseline
        title = f"{_fmt_size(row['size'])}: where one round trip goes (µs; medians per call, means per trip)"
        table = Table(title=title)
        table.add_column("part")
        for name in names:
            table.add_column(name if name == "connector" else f"raw {name}", justify="right")
        for label, side, key in _PROFILE_ROWS:
            cells = []
            for name in names:
                part = prof[name][side]
                if key == "switches":
                    cells.append(f"{part['voluntary_switches']:.1f} / {part['involuntary_switches']:.1f}")
                else:
                    cells.append(f"{part[key]:.1f}" if key in part else "—")
            table.add_row(label, *cells)
        console.print(table)
        for name in names:
            for side in ("attention", "ffn"):
                top = prof[name][side]["functions"][:_TOP_FUNCTIONS_SHOWN]
                text = ", ".join(f"{f['function']} {f['own_us']:.1f}" for f in top)
                console.print(f"  under cProfile, {name} {side}: {text}")
    for side, w in result["wake_penalty"].items():
        console.print(
            f"wake penalty ({side} rank): {w['hot_us']:.1f} µs of Python hot, {w['after_sleep_us']:.1f} µs right after "
            f"a {w['sleep_us']:.0f} µs sleep ({w['ratio']:.1f}×): every exchange's Python runs after a wait"
        )


def _plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["size"] for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(sizes, [r["connector"]["median_us"] for r in result["rows"]], "o-", label=result["connector"])
    for b in result["baselines"]:
        ax.plot(sizes, [r[b]["median_us"] for r in result["rows"]], "s--", label=f"raw {b}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("payload bytes (one direction)")
    ax.set_ylabel("median round trip (µs)")
    ax.set_title(f"{result['connector']} vs raw transport")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def attach(cli: click.Group) -> None:
    cli.add_command(bench_group)


@bench_group.command("serve")
@click.option("--connector", "connectors", default="zmq", show_default=True, help="Comma list of connectors.")
@click.option(
    "--setup",
    "setups",
    default="one-engine,dp2,two-worlds",
    show_default=True,
    help="Comma list: one-engine, dp2 (--data-parallel-size 2, one world), two-worlds (two engines, one FFN).",
)
@click.option("--arch", default="Qwen3MoeForCausalLM", show_default=True, help="Tiny serving checkpoint's model.")
@click.option("--model", type=click.Path(exists=True, file_okay=False), help="A checkpoint instead of the tiny one.")
@click.option("--num-prompts", type=click.IntRange(2, 100_000), default=32, show_default=True)
@click.option("--max-concurrency", type=click.IntRange(1, 4096), default=8, show_default=True)
@click.option("--input-len", type=click.IntRange(1, 65536), default=24, show_default=True)
@click.option("--output-len", type=click.IntRange(2, 65536), default=24, show_default=True)
@click.option("--max-num-seqs", type=click.IntRange(1, 4096), default=8, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(16, 1 << 20), default=256, show_default=True)
@click.option(
    "--repeats",
    type=click.IntRange(1, 100),
    default=1,
    show_default=True,
    help="Rounds of every deployment in turns; each AFD run against its round's native run, the median reported.",
)
@click.option(
    "--extra-config",
    "extra_configs",
    multiple=True,
    metavar="CONNECTOR=JSON",
    help="connector_extra_config of one connector's AFD deployments, e.g. 'shm={\"spin_us\": 0}'; repeatable.",
)
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False),
    default="afd-bench-serve",
    show_default=True,
    help="Checkpoint, server logs and the load client's raw results.",
)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Write a PNG of the AFD/native ratios.")
@click.option("--json", "as_json", is_flag=True)
def bench_serve(
    connectors: str,
    setups: str,
    arch: str,
    model: str | None,
    num_prompts: int,
    max_concurrency: int,
    input_len: int,
    output_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    repeats: int,
    extra_configs: tuple[str, ...],
    work_dir: str,
    plot_path: str | None,
    as_json: bool,
) -> None:
    """AFD `vllm serve` against native `vllm serve`, driven by vLLM's own `vllm bench serve` (random data).

    Native and AFD deployments run one after the other with the same checkpoint, engine flags and load;
    reports output tok/s, TTFT and TPOT p50/p99, AFD/native ratios, the FFN batch fill and where an
    exchange's time goes. Needs the vLLM environment (scripts/bootstrap-vllm.sh).
    """
    from pathlib import Path

    from afd_sdk.bench.serve_bench import ServeBenchOptions, plot, run_serve_bench, validate_options

    opts = ServeBenchOptions(
        connectors=_comma_list(connectors),
        setups=_comma_list(setups),
        arch=arch,
        model=model,
        num_prompts=num_prompts,
        max_concurrency=max_concurrency,
        input_len=input_len,
        output_len=output_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        repeats=repeats,
        extra_configs=_extra_configs(extra_configs),
        work_dir=Path(work_dir),
    )
    validate_options(opts)  # before any process: a bad setup or connector name is exit 2, not a half-run
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise AFDConfigError(
                "--plot needs matplotlib in this environment (pip install matplotlib)", key="plot", value=plot_path
            ) from exc
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise AFDConfigError(
            "afd bench serve needs vLLM in this environment; expected the vLLM tier's (scripts/bootstrap-vllm.sh)",
            key="engine",
            value="vllm",
        ) from exc
    result = run_serve_bench(opts, None if as_json else lambda m: click.echo(f"  {m}", err=True))
    (opts.work_dir / "result.json").write_text(json.dumps(result, indent=2))  # kept whatever follows
    if plot_path:
        plot(result, Path(plot_path))
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        _print_serve(result)


def _extra_configs(items: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """``--extra-config CONNECTOR=JSON`` items as connector -> JSON object (one item per connector)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        raw_name, sep, text = item.partition("=")
        name = raw_name.strip()
        try:
            value = json.loads(text) if sep and name else None
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise AFDConfigError(
                f"--extra-config {item!r} is not CONNECTOR=JSON; expected e.g. 'shm={{\"spin_us\": 0}}'",
                key="connector_extra_config",
                value=item,
            )
        if name in out:
            raise AFDConfigError(
                f"--extra-config names {name!r} twice; expected one object per connector",
                key="connector_extra_config",
                value=item,
            )
        out[name] = value
    return out


def _ratio_cell(row: dict[str, Any]) -> str:
    rounds = row.get("round_ratios", ())
    spread = f"\n({min(rounds):.2f}–{max(rounds):.2f})" if len(rounds) > 1 else ""
    return f"{row['ratio']['output_tok_s']:.2f}×{spread}"


def _connector_cell(row: dict[str, Any]) -> str:
    extra = row.get("connector_extra_config")
    return f"{row['connector']}\n{json.dumps(extra, separators=(',', ':'))}" if extra else row["connector"]


def _print_serve(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    load = r["load"]
    rounds = r.get("repeats", 1)
    table = Table(
        title=f"afd bench serve: {r['arch']}, vllm bench serve random {load['input_len']} in / {load['output_len']} "
        f"out, {load['num_prompts']} prompts, concurrency {load['max_concurrency']}"
        + (f"; median of {rounds} rounds in turns (range)" if rounds > 1 else "")
    )
    cols = ("setup", "connector", "run", "tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "AFD÷native tok/s")
    for col in (*cols, "FFN batch tok", "exchange µs (FFN compute + rest)"):
        table.add_column(col, justify="left" if col in ("setup", "connector", "run") else "right")
    for row in r["rows"]:
        for run in ("native", "afd"):
            m = row[run]
            a = m.get("afd")
            table.add_row(
                row["setup"] if run == "native" else "",
                _connector_cell(row) if run == "native" else "",
                f"native x{row['native_engines']}" if run == "native" else "AFD",
                f"{m['output_tok_s']:.1f}" + (f" (overlap {m['overlap']:.2f})" if m.get("overlap", 1.0) < 1 else ""),
                f"{m['ttft_ms']['p50']:.0f}/{m['ttft_ms']['p99']:.0f}",
                f"{m['tpot_ms']['p50']:.1f}/{m['tpot_ms']['p99']:.1f}",
                _ratio_cell(row) if run == "afd" else "",
                f"{a['ffn_batch_tokens_mean']:.1f}" if a else "",
                f"{a['exchange_us_mean']:.0f} ({a['ffn_compute_us_mean']:.0f} + {a['exchange_other_us_mean']:.0f})"
                if a
                else "",
                end_section=run == "afd",
            )
    Console(highlight=False, width=max(140, Console().width)).print(table)
