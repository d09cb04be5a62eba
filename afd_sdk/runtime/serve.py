"""Pick the FFN role's server loop by the connector's declared capability."""

from __future__ import annotations

from typing import Any

from afd_sdk.connector import AFDConnector, ConnectorBase
from afd_sdk.dispatch import AsyncDispatchConnector
from afd_sdk.errors import ConnectorError
from afd_sdk.metrics import AFDMetrics
from afd_sdk.runtime.expert_server import ExpertServer
from afd_sdk.runtime.ffn_server import FFNServer

__all__ = ["server_for"]


def server_for(
    connector: ConnectorBase, model: Any, *, max_steps: int | None = None, metrics: AFDMetrics | None = None
) -> Any:
    """The server loop for ``connector``, chosen by its declared ``async_dispatch`` capability.

    ``model`` is the FFN role's model from the binding: ``FFNBlocks`` for a
    point-to-point connector, ``RoutedExperts`` for a routed-dispatch one;
    ``metrics`` (optional) records every exchange for ``/metrics``.
    """
    if connector.capabilities.async_dispatch:
        if not isinstance(connector, AsyncDispatchConnector):
            raise ConnectorError(
                f"{type(connector).__name__} declares async_dispatch=True but is no AsyncDispatchConnector"
            )
        return ExpertServer(connector, model, max_items=max_steps, metrics=metrics)
    if not isinstance(connector, AFDConnector):
        raise ConnectorError(f"{type(connector).__name__} declares async_dispatch=False but is no AFDConnector")
    return FFNServer(connector, model, max_steps=max_steps, metrics=metrics)
