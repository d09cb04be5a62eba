"""Why NIXL cannot run in this environment, for the tests outside ``connectors/nixl`` that run it too."""

from __future__ import annotations

__all__ = ["nixl_missing"]


def nixl_missing() -> str | None:
    """The reason NIXL does not import here, or ``None`` (scripts/bootstrap*.sh install it)."""
    try:
        from afd_connector_nixl.agent import nixl_api

        nixl_api()
    except Exception as exc:  # the distribution or NIXL itself does not import: say which
        return f"NIXL does not import here: {type(exc).__name__}: {exc}"
    return None
