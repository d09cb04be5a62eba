"""The ``afd`` command.

One module per command group (``plugins``, ``config``, ``topology``,
``runtime`` (demo, ffn, attention), ``weights``, ``bench``, ``plan``); each attaches
its commands to :data:`cli` and imports its heavy parts lazily.

Exit codes: 0 ok; 1 a check ran and failed (e.g. a split model differs from
native); 2 invalid input or config; 3 a peer was lost (``PeerLostError``: it
died, froze or became unreachable; an orchestrator may restart and retry);
130 interrupted. Errors print as one ``error: …`` line on stderr with no
traceback. ``--json`` puts machine output on stdout.
"""

from __future__ import annotations

import click

from afd_sdk.errors import AFDError, PeerLostError

__all__ = ["EXIT_PEER_LOST", "cli", "main"]

#: exit code of a command that lost a peer (see the module docstring)
EXIT_PEER_LOST = 3


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="afd-sdk", prog_name="afd")
def cli() -> None:
    """afd-sdk: Attention–FFN Disaggregation tools."""


def _register_subcommands() -> None:
    """Sub-command groups that live in their own modules; each imports its heavy parts lazily."""
    from afd_sdk.cli import bench, config, plan, plugins, runtime, topology, weights

    for module in (plugins, config, topology, runtime, weights, bench, plan):
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
    except PeerLostError as exc:
        click.echo(f"error: {exc}", err=True)
        return EXIT_PEER_LOST
    except AFDError as exc:  # registration errors (a target of the wrong class) included
        click.echo(f"error: {exc}", err=True)
        return 2
    return int(rv) if isinstance(rv, int) else 0
