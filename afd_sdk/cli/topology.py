"""``afd topology``: the rank map a connector would use."""

from __future__ import annotations

import click

from afd_sdk.cli.output import console, echo_json

__all__ = ["attach"]


@click.command("topology")
@click.option("--connector", "connector", required=True, help="Connector name or alias.")
@click.option("--attention", "num_attention", type=int, required=True, help="Number of Attention ranks (A).")
@click.option("--ffn", "num_ffn", type=int, required=True, help="Number of FFN ranks (F).")
@click.option("--experts", "num_experts", type=int, default=None, help="Routed experts (attention-first connectors).")
@click.option("--json", "as_json", is_flag=True)
def topology_cmd(connector: str, num_attention: int, num_ffn: int, num_experts: int | None, as_json: bool) -> None:
    """Print the rank map a connector would use for A Attention and F FFN ranks."""
    from afd_sdk.errors import AFDConfigError
    from afd_sdk.plugins import get_plugin_manager
    from afd_sdk.topology import build_world

    cls = get_plugin_manager().connector_class(connector)
    layout = cls.capabilities.world_layout
    if layout == "attention_first" and num_experts is None:
        raise AFDConfigError(
            f"--experts is required for {cls.name}, an attention-first connector; "
            "expected the number of routed experts",
            key="experts",
        )
    world = build_world(layout, num_attention, num_ffn, num_experts=num_experts)
    data = {"connector": cls.name, **world.as_dict()}
    if as_json:
        echo_json(data)
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
    console().print(table)


def attach(cli: click.Group) -> None:
    cli.add_command(topology_cmd)
