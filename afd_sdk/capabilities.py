"""What a connector can do, declared once per connector class.

Its own module so that the model-adapter contract (:class:`~afd_sdk.adapter.Deployment`)
can carry a connector's capabilities without depending on the connector contract.
"""

from __future__ import annotations

from dataclasses import dataclass

from afd_sdk.topology import WorldLayout
from afd_sdk.wire import COMMON_DTYPES

__all__ = ["ConnectorCapabilities"]


@dataclass(frozen=True)
class ConnectorCapabilities:
    """What a connector can do; the runtime, the model adapters and the conformance suites read it.

    * ``devices``: tensor devices accepted (``"cpu"``, ``"cuda"``, ``"npu"``).
    * ``world_layout``: which rank ordering it uses (see :mod:`afd_sdk.topology`).
    * ``attention_lt_ffn``: whether A < F is supported.
    * ``supports_extras``: whether declared FFN extras travel with hidden states.
    * ``async_dispatch``: routed-expert dispatch/combine (an
      :class:`~afd_sdk.dispatch.AsyncDispatchConnector`) rather than whole
      hidden states per layer. Model adapters decide gate-on-Attention support
      by this flag, never by a connector's name.
    * ``dtypes``: tensor dtypes it moves (names of :data:`afd_sdk.wire.WIRE_DTYPES`).
    * ``same_host_only``: both roles must share a host (shared memory).
    """

    devices: frozenset[str] = frozenset({"cpu"})
    world_layout: WorldLayout = "ffn_first"
    attention_lt_ffn: bool = False
    supports_extras: bool = True
    async_dispatch: bool = False
    dtypes: frozenset[str] = COMMON_DTYPES
    same_host_only: bool = False
