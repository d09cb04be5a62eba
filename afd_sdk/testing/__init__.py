"""Test kits shipped with afd-sdk for plugin authors.

* :class:`ConnectorConformance` — subclass it to run the connector suite.
* :class:`AsyncDispatchConformance` — the suite for routed-dispatch (CAM-style) connectors.
* :class:`AdapterConformance` — subclass it to check a model adapter's transformers binding.
* :class:`VllmAdapterConformance` — the same for its vLLM binding, inside real vLLM (runs where vLLM is installed).
* :func:`run_world` — start an AFD world of real processes on loopback.
* :func:`init_in_threads` — initialise both roles in one process, for call-by-call tests.
"""

from afd_sdk.runtime.world import free_port_block, run_world
from afd_sdk.testing.adapters import AdapterConformance
from afd_sdk.testing.conformance import ConnectorConformance
from afd_sdk.testing.dispatch_conformance import AsyncDispatchConformance
from afd_sdk.testing.in_process import init_in_threads
from afd_sdk.testing.vllm_adapters import VllmAdapterConformance

__all__ = [
    "AdapterConformance",
    "AsyncDispatchConformance",
    "ConnectorConformance",
    "VllmAdapterConformance",
    "free_port_block",
    "init_in_threads",
    "run_world",
]
