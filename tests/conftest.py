import importlib.util
import os

import pytest

from afd_sdk.plugins import reset_plugin_manager
from afd_sdk.testing import disable_warm_workers, enable_warm_workers


def _warm_workers_wanted() -> bool:
    # AFD_COLD_WORKERS=1 runs every rank as a fresh interpreter (what afd demo does); the vLLM tier's environment
    # starts cold too: its ranks are mostly vLLM's own engines, which never fork from the zygote
    return os.environ.get("AFD_COLD_WORKERS") != "1" and importlib.util.find_spec("vllm") is None


def pytest_configure(config):
    if _warm_workers_wanted() and not hasattr(config, "workerinput"):
        enable_warm_workers()


def pytest_unconfigure(config):
    disable_warm_workers()


@pytest.fixture
def fresh_plugins(monkeypatch):
    """A process-wide plugin manager rebuilt for this test and forgotten after it."""
    monkeypatch.delenv("AFD_PLUGINS", raising=False)
    monkeypatch.delenv("AFD_DISABLE_PLUGINS", raising=False)
    reset_plugin_manager()
    yield
    reset_plugin_manager()
