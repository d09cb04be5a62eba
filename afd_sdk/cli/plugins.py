"""``afd plugins``: every plugin, its distribution, what it registered (with aliases), load errors."""

from __future__ import annotations

import click

from afd_sdk.cli.output import console, echo_json

__all__ = ["attach"]


def _with_aliases(name: str, aliases: dict[str, list[str]]) -> str:
    short = aliases.get(name) or []
    return f"{name} ({', '.join(short)})" if short else name


@click.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
def plugins_cmd(as_json: bool) -> None:
    """List plugins, what each registered, and load errors."""
    from afd_sdk.plugins import get_plugin_manager

    pm = get_plugin_manager()
    data = pm.as_dict()
    if as_json:
        echo_json(data)
        return
    from rich.table import Table

    table = Table(title="afd-sdk plugins")
    for col in ("plugin", "distribution", "status", "connectors", "model adapters", "providers"):
        table.add_column(col)
    aliases = {c["name"]: c["aliases"] for c in data["connectors"]}
    for rec in data["plugins"]:
        dist = f"{rec['distribution']} {rec['version']}" if rec["distribution"] else rec["kind"]
        status = rec["status"] if rec["status"] == "loaded" else f"{rec['status']}: {rec['error'] or rec['reason']}"
        reg = rec["registered"]
        table.add_row(
            rec["name"],
            dist,
            status,
            ", ".join(_with_aliases(n, aliases) for n in reg["connectors"]),
            ", ".join(reg["model_adapters"]),
            ", ".join(reg["metadata_providers"]),
        )
    console().print(table)


def attach(cli: click.Group) -> None:
    cli.add_command(plugins_cmd)
