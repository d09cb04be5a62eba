"""``afd config check``: validate an ``afd`` mapping the way every worker will."""

from __future__ import annotations

import click

from afd_sdk.cli.output import echo_json

__all__ = ["attach"]


@click.group("config")
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
        echo_json(out)
    else:
        click.echo(f"ok: {cfg.role} config for {resolved.connector_cls.name or cfg.connector}")
        echo_json(out)


def attach(cli: click.Group) -> None:
    cli.add_command(config_group)
