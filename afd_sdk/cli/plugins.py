"""``afd plugins``: every plugin, its distribution, what it registered (with aliases), load errors, and each
connector's optional native modules (which loaded, why the others did not: the Python fallbacks in use)."""

from __future__ import annotations

from typing import Any

import click

from afd_sdk.cli.output import console, echo_json

__all__ = ["attach"]


def _native(pm: Any, name: str) -> dict[str, Any]:
    """``native`` (module -> ``None`` or why it does not load) and ``load_error`` of one registered connector."""
    try:
        return {"native": dict(pm.connector_class(name).native_modules()), "load_error": None}
    except Exception as exc:  # a broken plugin is reported, never fatal to the listing
        return {"native": {}, "load_error": f"{type(exc).__name__}: {exc}"}


def _fallbacks(conn: dict[str, Any]) -> list[str]:
    if conn["load_error"]:
        return [f"{conn['name']}: {conn['load_error']}"]
    return [f"{conn['name']}: {why}" for why in conn["native"].values() if why]


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
    for conn in data["connectors"]:
        conn.update(_native(pm, conn["name"]))
    if as_json:
        echo_json(data)
        return
    from rich.table import Table

    table = Table(title="afd-sdk plugins")
    for col in ("plugin", "distribution", "status", "connectors", "model adapters", "providers", "fallbacks"):
        table.add_column(col)
    aliases = {c["name"]: c["aliases"] for c in data["connectors"]}
    fallbacks = {c["name"]: _fallbacks(c) for c in data["connectors"]}
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
            "; ".join(f for n in reg["connectors"] for f in fallbacks.get(n, ())),
        )
    console().print(table)


def attach(cli: click.Group) -> None:
    cli.add_command(plugins_cmd)
