import pytest

from afd_sdk.plugins import reset_plugin_manager


@pytest.fixture
def fresh_plugins(monkeypatch):
    """A process-wide plugin manager rebuilt for this test and forgotten after it."""
    monkeypatch.delenv("AFD_PLUGINS", raising=False)
    monkeypatch.delenv("AFD_DISABLE_PLUGINS", raising=False)
    reset_plugin_manager()
    yield
    reset_plugin_manager()
