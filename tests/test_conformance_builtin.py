"""The built-in connectors pass the shipped conformance suite (real processes, loopback)."""

import pytest

from afd_sdk.testing import ConnectorConformance

pytestmark = pytest.mark.multiprocess


class TestZmqTcp(ConnectorConformance):
    connector = "zmq"


class TestZmqIpc(ConnectorConformance):
    connector = "ZmqAFDConnector"
    extra_config = {"transport": "ipc"}


class TestP2pGloo(ConnectorConformance):
    connector = "P2pNcclAFDConnector"


class TestShm(ConnectorConformance):
    connector = "shm"


class TestCamPointToPointSuite(ConnectorConformance):
    """The point-to-point suite on CAM: every test skips, saying that CAM's world is Attention-first;
    the routed-dispatch suite runs in test_cam_dispatch.py."""

    connector = "CAMAsyncAFDConnector"
