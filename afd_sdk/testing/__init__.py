"""Test kits shipped with afd-sdk for plugin authors.

* :class:`ConnectorConformance` — subclass it to run the connector suite.
* :class:`AsyncDispatchConformance` — the suite for routed-dispatch (CAM-style) connectors.
* :class:`AdapterConformance` — subclass it to check a model adapter's transformers binding.
* :class:`VllmAdapterConformance` — the same for its vLLM binding, inside real vLLM (runs where vLLM is installed).
* :func:`run_world` — start an AFD world of real processes on loopback.
* :func:`init_in_threads` — initialise both roles in one process, for call-by-call tests.
* :func:`enable_warm_workers` — fork world ranks from a process that already imported torch (a suite's start-up).
"""

from afd_sdk.runtime.world import free_port_block, run_world
from afd_sdk.runtime.zygote import disable as disable_warm_workers
from afd_sdk.runtime.zygote import enable as _enable_zygote
from afd_sdk.testing.adapters import AdapterConformance
from afd_sdk.testing.conformance import ConnectorConformance
from afd_sdk.testing.dispatch_conformance import AsyncDispatchConformance
from afd_sdk.testing.in_process import init_in_threads
from afd_sdk.testing.vllm_adapters import VllmAdapterConformance


def enable_warm_workers() -> None:
    """Start the rank of every later :func:`run_world` by forking a process that has already imported torch,
    transformers and afd-sdk, instead of a fresh interpreter (seconds saved per rank).

    Call it once per test session (a ``pytest_configure`` hook or a session fixture) and
    :func:`disable_warm_workers` at its end. A rank whose module is vLLM's, or whose environment differs from the
    caller's in what is read at import (``PYTHON*``, ``LD_*``, thread counts), still starts cold.
    """
    _enable_zygote()


__all__ = [
    "AdapterConformance",
    "AsyncDispatchConformance",
    "ConnectorConformance",
    "VllmAdapterConformance",
    "disable_warm_workers",
    "enable_warm_workers",
    "free_port_block",
    "init_in_threads",
    "run_world",
]
