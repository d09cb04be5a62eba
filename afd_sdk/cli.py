"""The ``afd`` command.

Exit codes: 0 ok; 1 a check ran and failed (e.g. a split model differs from
native); 2 invalid input, printed as one ``error: …`` line on stderr with no
traceback. ``--json`` puts machine output on stdout.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from afd_sdk.errors import AFDError

__all__ = ["cli", "main"]


def _echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="afd-sdk", prog_name="afd")
def cli() -> None:
    """afd-sdk: Attention–FFN Disaggregation tools."""


@cli.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
def plugins_cmd(as_json: bool) -> None:
    """List plugins, what each registered, and load errors."""
    from afd_sdk.plugins import get_plugin_manager

    pm = get_plugin_manager()
    data = pm.as_dict()
    if as_json:
        _echo_json(data)
        return
    from rich.table import Table

    table = Table(title="afd-sdk plugins")
    for col in ("plugin", "distribution", "status", "connectors", "model adapters", "providers"):
        table.add_column(col)
    for rec in data["plugins"]:
        dist = f"{rec['distribution']} {rec['version']}" if rec["distribution"] else rec["kind"]
        status = rec["status"] if rec["status"] == "loaded" else f"{rec['status']}: {rec['error'] or rec['reason']}"
        reg = rec["registered"]
        table.add_row(
            rec["name"],
            dist,
            status,
            ", ".join(reg["connectors"]),
            ", ".join(reg["model_adapters"]),
            ", ".join(reg["metadata_providers"]),
        )
    _console().print(table)


@cli.group("config")
def config_group() -> None:
    """Configuration tools."""


@config_group.command("check")
@click.argument("config")
@click.option("--json", "as_json", is_flag=True, help="Print the normalised config as JSON.")
def config_check(config: str, as_json: bool) -> None:
    """Validate CONFIG (JSON string or path; the afd mapping or {"afd": {...}})."""
    from afd_sdk.config import parse_config
    from afd_sdk.plugins import get_plugin_manager

    cfg = parse_config(config)
    resolved = get_plugin_manager().resolve_config(cfg)
    import msgspec

    out = {
        "afd": cfg.to_dict(),
        "connector_class": f"{resolved.connector_cls.__module__}:{resolved.connector_cls.__qualname__}",
        "connector_extra_config": msgspec.to_builtins(resolved.extra_config),
    }
    if as_json:
        _echo_json(out)
    else:
        click.echo(f"ok: {cfg.role} config for {resolved.connector_cls.name or cfg.connector}")
        _echo_json(out)


@cli.command("topology")
@click.option("--connector", "connector", required=True, help="Connector name or alias.")
@click.option("--attention", "num_attention", type=int, required=True, help="Number of Attention ranks (A).")
@click.option("--ffn", "num_ffn", type=int, required=True, help="Number of FFN ranks (F).")
@click.option("--experts", "num_experts", type=int, default=None, help="Routed experts (attention-first connectors).")
@click.option("--json", "as_json", is_flag=True)
def topology_cmd(connector: str, num_attention: int, num_ffn: int, num_experts: int | None, as_json: bool) -> None:
    """Print the rank map a connector would use for A Attention and F FFN ranks."""
    from afd_sdk.errors import AFDConfigError
    from afd_sdk.plugins import get_plugin_manager
    from afd_sdk.topology import attention_first_world, ffn_first_world

    cls = get_plugin_manager().connector_class(connector)
    if cls.capabilities.world_layout == "attention_first":
        if num_experts is None:
            raise AFDConfigError(
                f"--experts is required for {cls.name}, an attention-first connector; "
                "expected the number of routed experts",
                key="experts",
            )
        world: Any = attention_first_world(num_attention, num_ffn, num_experts)
    else:
        world = ffn_first_world(num_attention, num_ffn)
    data = {"connector": cls.name, **world.as_dict()}
    if as_json:
        _echo_json(data)
        return
    from rich.table import Table

    table = Table(title=f"{cls.name}: {num_attention}A{num_ffn}F ({data['layout']})")
    for col in ("global rank", "role", "role rank", "peers", *(["experts"] if "num_experts" in data else [])):
        table.add_column(col)
    for r in data["ranks"]:
        row = [str(r["global_rank"]), r["role"], str(r["role_rank"]), ",".join(map(str, r["peers"]))]
        if "num_experts" in data:
            row.append(",".join(map(str, r.get("experts", []))))
        table.add_row(*row)
    _console().print(table)


def _register_subcommands() -> None:
    """Sub-command groups that live in their own modules; each imports its heavy parts lazily."""
    from afd_sdk import cli_bench, cli_runtime, cli_weights

    for module in (cli_runtime, cli_weights, cli_bench):
        module.attach(cli)


_register_subcommands()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``afd`` console script; returns the exit code."""
    try:
        rv = cli.main(args=argv, prog_name="afd", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("error: interrupted", err=True)
        return 130
    except click.UsageError as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        return 2
    except click.ClickException as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        return 2
    except AFDError as exc:
        click.echo(f"error: {exc}", err=True)
        return 2
    except TypeError as exc:  # a registry target that is not the right class
        if "is not a subclass of" not in str(exc):
            raise
        click.echo(f"error: {exc}", err=True)
        return 2
    return int(rv) if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
