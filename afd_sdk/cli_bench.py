"""``afd bench …`` commands: our code against the raw layer under it, in one run."""

from __future__ import annotations

import json
from typing import Any

import click

from afd_sdk.errors import AFDConfigError


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
    help="Round trips per size (fewer above 512K).",
)
@click.option(
    "--raw", "raw", default=None, help="Comma list of raw baselines: zmq, gloo, memcpy (default: the connector's own)."
)
@click.option("--extra-config", default="{}", help="connector_extra_config as JSON.")
@click.option("--json", "as_json", is_flag=True)
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Write a latency-vs-size PNG.")
def bench_connector(
    connector: str, sizes: str, iters: int, raw: str | None, extra_config: str, as_json: bool, plot: str | None
) -> None:
    """Round-trip latency and throughput of CONNECTOR vs. its raw transport."""
    from afd_sdk.bench.connector_bench import parse_size, run_benchmark

    size_list = [parse_size(s) for s in sizes.split(",") if s.strip()]
    baselines = None
    if raw is not None:
        baselines = tuple(b.strip() for b in raw.split(",") if b.strip())
        bad = [b for b in baselines if b not in ("zmq", "gloo", "memcpy")]
        if bad:
            raise AFDConfigError(f"--raw {bad[0]!r} is invalid; expected zmq, gloo or memcpy", key="raw", value=bad[0])
    try:
        extra = json.loads(extra_config)
    except json.JSONDecodeError as exc:
        raise AFDConfigError(f"--extra-config is not JSON: {exc}", key="extra-config", value=extra_config) from None
    if plot is not None:
        _require_matplotlib()
    if not as_json:
        click.echo(
            f"benchmarking {connector} at {', '.join(map(_fmt_size, size_list))} (2 processes, loopback)…", err=True
        )
    result = run_benchmark(connector, size_list, iters=iters, baselines=baselines, extra_config=extra)
    if plot is not None:
        _plot(result, plot)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    _print_table(result)


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result['connector']} round trip (fp32, hidden {result['hidden']})")
    table.add_column("size", justify="right")
    table.add_column("connector median/p90 µs", justify="right")
    for b in result["baselines"]:
        table.add_column(f"raw {b} median/p90 µs", justify="right")
        table.add_column(f"ratio vs {b}", justify="right")
        table.add_column(f"Δ vs {b} µs", justify="right")
    table.add_column("connector GB/s", justify="right")
    for row in result["rows"]:
        c = row["connector"]
        cells = [_fmt_size(row["size"]), f"{c['median_us']:.1f} / {c['p90_us']:.1f}"]
        for b in result["baselines"]:
            r = row[b]
            cells += [
                f"{r['median_us']:.1f} / {r['p90_us']:.1f}",
                f"{row[f'ratio_{b}']:.2f}×",
                f"{row[f'delta_{b}_us']:+.1f}",
            ]
        cells.append(f"{c['gbps']:.2f}")
        table.add_row(*cells)
    Console(highlight=False).print(table)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise AFDConfigError("--plot needs matplotlib; install afd-sdk[dev] or matplotlib", key="plot") from None


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
