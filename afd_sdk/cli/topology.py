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
@click.option(
    "--expert-replicas",
    "expert_replicas",
    type=int,
    default=1,
    show_default=True,
    help="FFN ranks holding each routed expert (CAM's connector_extra_config.expert_replicas).",
)
@click.option("--json", "as_json", is_flag=True)
def topology_cmd(
    connector: str, num_attention: int, num_ffn: int, num_experts: int | None, expert_replicas: int, as_json: bool
) -> None:
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
    if expert_replicas != 1 and layout != "attention_first":
        raise AFDConfigError(
            f"--expert-replicas={expert_replicas} places routed experts; {cls.name} is not an attention-first "
            "(routed-dispatch) connector: expected 1",
            key="expert_replicas",
            value=expert_replicas,
        )
    world = build_world(layout, num_attention, num_ffn, num_experts=num_experts, expert_replicas=expert_replicas)
    data = {"connector": cls.name, **world.as_dict()}
    if as_json:
        echo_json(data)
        return
    from rich.table import Table

    table = Table(title=f"{cls.name}: {num_attention}A{num_ffn}F ({data['layout']})")
    routed = "num_experts" in data
    for col in ("global rank", "role", "role rank", "peers", *(["experts", "primary"] if routed else [])):
        table.add_column(col)
    for r in data["ranks"]:
        row = [str(r["global_rank"]), r["role"], str(r["role_rank"]), ",".join(map(str, r["peers"]))]
        if routed:
            row += [",".join(map(str, r.get("experts", []))), ",".join(map(str, r.get("primary_experts", [])))]
        table.add_row(*row)
    console().print(table)


def attach(cli: click.Group) -> None:
    cli.add_command(topology_cmd)
