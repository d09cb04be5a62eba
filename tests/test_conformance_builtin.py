"""The built-in connectors pass the shipped conformance suite (real processes, loopback)."""

import pytest

from afd_sdk.testing import ConnectorConformance

pytestmark = pytest.mark.multiprocess


class TestZmqTcp(ConnectorConformance):
    connector = "zmq"


class TestZmqIpc(ConnectorConformance):
    connector = "ZmqAFDConnector"
    extra_config = {"transport": "ipc"}

    @pytest.fixture(autouse=True)
    def _sockets_in_tmp_path(self, tmp_path, monkeypatch):
        """Socket files go under the test's own directory: a SIGKILLed binder cannot remove its own."""
        monkeypatch.setenv("TMPDIR", str(tmp_path))


class TestP2pGloo(ConnectorConformance):
    connector = "P2pNcclAFDConnector"


class TestShm(ConnectorConformance):
    connector = "shm"


class TestCamPointToPointSuite(ConnectorConformance):
    """The point-to-point suite on CAM: every test skips, saying that CAM's world is Attention-first;
    the routed-dispatch suite runs in test_cam_dispatch.py."""

    connector = "CAMAsyncAFDConnector"
