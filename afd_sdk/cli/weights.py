"""``afd weights classify``: which role loads each checkpoint tensor (headers only)."""

from __future__ import annotations

import json
from typing import Any

import click

from afd_sdk.errors import AFDConfigError

_PROGRESS_MIN = 100_000


@click.group("weights")
def weights_group() -> None:
    """Checkpoint tools."""


@weights_group.command("classify")
@click.argument("path", type=click.Path(exists=True))
@click.option("--arch", default=None, help="Architecture (default: the config's architectures[0]).")
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="HF config.json, where PATH has none.",
)
@click.option("--gate-on-attention", is_flag=True, help="Classify as with compute_gate_on_attention=true.")
@click.option("--json", "as_json", is_flag=True)
def classify_cmd(path: str, arch: str | None, config_path: str | None, gate_on_attention: bool, as_json: bool) -> None:
    """Classify every tensor of PATH (checkpoint dir, .safetensors file, or names file) by role.

    Exit 1 when any name is unclassified.
    """
    from afd_sdk.plugins import get_plugin_manager
    from afd_sdk.weights import classify, read_checkpoint, read_hf_config

    ckpt = read_checkpoint(path)
    config = read_hf_config(config_path) if config_path else ckpt.config
    if config is None:
        raise AFDConfigError(
            f"{path!r} has no config.json; pass --config FILE with the model's HF config", key="config", value=None
        )
    if arch is None:
        archs = config.get("architectures") or []
        if not archs:
            raise AFDConfigError("the config has no 'architectures' entry; pass --arch", key="arch", value=None)
        arch = str(archs[0])
    adapter = get_plugin_manager().adapter_class(arch)(arch, config)
    progress_cb, finish = _progress(len(ckpt.names), enabled=not as_json and len(ckpt.names) >= _PROGRESS_MIN)
    try:
        report = classify(
            adapter, ckpt.names, ckpt.nbytes, compute_gate_on_attention=gate_on_attention, progress=progress_cb
        )
    finally:
        finish()
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=1))
    else:
        _print(report.as_dict())
    if report.unclassified:
        raise click.exceptions.Exit(1)


def _progress(total: int, *, enabled: bool) -> tuple[Any, Any]:
    if not enabled:
        return None, lambda: None
    from rich.progress import Progress

    bar = Progress(transient=True, console=_stderr_console())
    task = bar.add_task("classifying", total=total)
    bar.start()
    return (lambda n: bar.advance(task, n)), bar.stop


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(stderr=True)


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _print(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{data['architecture']}: tensors by role")
    table.add_column("role")
    table.add_column("tensors", justify="right")
    table.add_column("bytes", justify="right")
    for role in ("attention", "ffn", "both", "none", "unclassified"):
        table.add_row(role, str(data["counts"][role]), _fmt_bytes(data["bytes"].get(role)))
    console = Console(highlight=False)
    console.print(table)
    for name in data["unclassified"]:
        console.print(f"unclassified: {name}")


def attach(cli: click.Group) -> None:
    cli.add_command(weights_group)
