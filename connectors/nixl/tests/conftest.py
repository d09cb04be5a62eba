"""The NIXL distribution's tests: UCX stays on loopback, and each test skips with the reason where NIXL is absent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# UCX picks every interface it finds (eth0 too, even with UCX_TLS=tcp); the worker processes inherit this
os.environ.setdefault("UCX_NET_DEVICES", "lo")


def _missing() -> str | None:
    """Why NIXL cannot run here, or ``None``."""
    try:
        from afd_connector_nixl.agent import nixl_api
    except ImportError as exc:
        return f"afd-connector-nixl is not installed ({exc}); pip install -e connectors/nixl"
    try:
        nixl_api()
    except Exception as exc:  # the distribution is there, NIXL is not: say which import failed
        return str(exc)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _missing()
    if reason is None:
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.skip(reason=reason))
