"""The ``afd_sdk`` entry point of afd-connector-nixl: registers ``NixlAFDConnector`` (alias ``nixl``) by path.

Registration imports nothing heavy: NIXL loads when a connector is built.
"""

from __future__ import annotations

from afd_sdk import hookimpl
from afd_sdk.hookspecs import Register


@hookimpl
def afd_register_connectors(register: Register) -> None:
    register("NixlAFDConnector", "afd_connector_nixl.connector:NixlAFDConnector", aliases=("nixl",))
