"""The built-in connectors pass the shipped conformance suite (real processes, loopback)."""

import pytest

from afd_sdk.testing import ConnectorConformance

pytestmark = pytest.mark.multiprocess


class TestZmqTcp(ConnectorConformance):
    connector = "zmq"


#: the ipc class runs what the transport changes (sockets, their files, peer loss); the rest is the same code as tcp
_SAME_AS_TCP = pytest.mark.skip(reason="transport-independent (framing, checks, handshake): TestZmqTcp runs it")


class TestZmqIpc(ConnectorConformance):
    connector = "ZmqAFDConnector"
    extra_config = {"transport": "ipc"}

    @_SAME_AS_TCP
    def test_zero_token_stages(self) -> None: ...

    @_SAME_AS_TCP
    def test_dtypes(self) -> None: ...

    @_SAME_AS_TCP
    def test_extras_round_trip(self) -> None: ...

    @_SAME_AS_TCP
    def test_local_misuse_raises_clear_errors(self) -> None: ...

    @_SAME_AS_TCP
    def test_handshake_mismatch(self) -> None: ...

    @pytest.fixture(autouse=True)
    def _sockets_in_tmp_path(self, tmp_path, monkeypatch):
        """Socket files go under the test's own directory: a SIGKILLed binder cannot remove its own."""
        monkeypatch.setenv("TMPDIR", str(tmp_path))


class TestP2pGloo(ConnectorConformance):
    """The native wire where it is built (scripts/test.sh requires it in .venv), else the Python one."""

    connector = "P2pNcclAFDConnector"


#: the Python wire's class runs what the wire changes (every data path, errors, peer loss); the rest is the same code
_SAME_AS_NATIVE = pytest.mark.skip(reason="wire-independent (handshake, lifecycle, dtype checks): TestP2pGloo runs it")


class TestP2pGlooPythonWire(ConnectorConformance):
    connector = "P2pNcclAFDConnector"
    extra_config = {"wire": "python"}

    @_SAME_AS_NATIVE
    def test_dtypes(self) -> None: ...

    @_SAME_AS_NATIVE
    def test_handshake_mismatch(self) -> None: ...

    @_SAME_AS_NATIVE
    def test_close_after_failed_init(self) -> None: ...

    @_SAME_AS_NATIVE
    def test_lifecycle_reinit_and_no_leaks(self) -> None: ...


class TestShm(ConnectorConformance):
    connector = "shm"


class TestCamPointToPointSuite(ConnectorConformance):
    """The point-to-point suite on CAM: every test skips, saying that CAM's world is Attention-first;
    the routed-dispatch suite runs in test_cam_dispatch.py."""

    connector = "CAMAsyncAFDConnector"
