"""Built-in connector plugin: registers the bundled connectors lazily by path,
through the same hook a third-party package uses."""

from __future__ import annotations

from afd_sdk import hookimpl
from afd_sdk.hookspecs import Register


@hookimpl
def afd_register_connectors(register: Register) -> None:
    register("ZmqAFDConnector", "afd_connectors.zmq.connector:ZmqAFDConnector", aliases=("zmq",))
    register("P2pNcclAFDConnector", "afd_connectors.p2p.connector:P2pNcclAFDConnector", aliases=("p2p",))
    register("ShmAFDConnector", "afd_connectors.shm.connector:ShmAFDConnector", aliases=("shm",))
    register("CAMAsyncAFDConnector", "afd_connectors.cam.connector:CAMAsyncAFDConnector", aliases=("cam",))
