"""Output helpers shared by the ``afd`` commands."""

from __future__ import annotations

import json
from typing import Any

import click

__all__ = ["console", "echo_json", "require_matplotlib"]


def echo_json(obj: Any) -> None:
    """Machine output on stdout: indented JSON, unknown types as strings."""
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


def require_matplotlib() -> None:
    """Check ``--plot``'s dependency before any work starts."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        from afd_sdk.errors import AFDConfigError

        raise AFDConfigError("--plot needs matplotlib; install afd-sdk[dev] or matplotlib", key="plot") from None


def console() -> Any:
    """A rich console for human tables (imported lazily: ``afd --help`` stays fast)."""
    from rich.console import Console

    return Console(highlight=False)
