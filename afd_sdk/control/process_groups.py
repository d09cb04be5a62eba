"""torch.distributed pieces shared by the point-to-point connectors (p2p, CAM portable).

Groups are built directly on a store — one per micro-batch stage, so
concurrent stage threads never share a communicator — and the default
process group, which a serving engine owns, is never touched.

Every socket listens on a configured address, never on all interfaces: the
store's master is handed a socket already bound to ``afd.host`` (a
``TCPStore`` binds every interface otherwise: CVE-2025-47277 in vLLM), and
Gloo's device is bound to the interface that routes to ``afd.host`` (by
default Gloo resolves the host name, which is 127.0.0.1 in a container or
network namespace, and the peers on another host are refused).
"""

from __future__ import annotations

import datetime
import fcntl
import functools
import logging
import os
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

from afd_sdk.errors import AFDConfigError, ConnectorError, PeerLostError

__all__ = [
    "check_store_port",
    "interface_of",
    "open_tcp_store",
    "route_source",
    "shutdown_groups",
    "stage_groups",
    "wait_works",
]

logger = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915


def addrinfo(host: str, port: int, wait_s: float = 0.0, *, family: int = 0, kind: int = socket.SOCK_STREAM) -> list:
    """``socket.getaddrinfo(host, port, family, kind)``, retrying a name that does not resolve yet for ``wait_s``.

    A peer pod's DNS record may appear after the pod starts; the last ``socket.gaierror`` propagates.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return socket.getaddrinfo(host, port, family, kind)
        except socket.gaierror:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


def route_source(host: str, port: int, wait_s: float = 0.0) -> str:
    """The local address this host sends from to reach ``host:port`` (the route's source; nothing is sent).

    A host name that does not resolve yet is retried for ``wait_s`` (:func:`addrinfo`).
    """
    try:
        family, _, _, _, addr = addrinfo(host, port, wait_s, kind=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(addr)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise ConnectorError(f"no route from this host to afd.host={host!r} port {port}: {exc}") from exc


def interface_of(address: str) -> str | None:
    """The name of the local IPv4 interface that holds ``address`` (``None`` when none does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def check_store_port(port: int, store_port: object, num_ffn_ranks: int) -> None:
    """``AFDConfigError`` when ``connector_extra_config.store_port`` falls on the control ports ``port .. port+F-1``.

    Called by the ``validate_config`` of connectors that host a ``TCPStore`` beside the ZMQ control plane.
    """
    if isinstance(store_port, int) and port <= store_port < port + num_ffn_ranks:
        raise AFDConfigError(
            f"afd.connector_extra_config.store_port={store_port} collides with the control ports "
            f"{port}..{port + num_ffn_ranks - 1}; pick a port outside that range",
            key="afd.connector_extra_config.store_port",
            value=store_port,
        )


def open_tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float, what: str) -> Any:
    """The world's ``TCPStore``; the master listens on ``host:port`` only.

    ``PeerLostError`` naming the address when the rendezvous of
    ``world_size`` ranks does not complete within ``timeout_s``;
    ``ConnectorError`` when the master cannot bind the address.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    listen_fd = None
    if is_master:
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            listener = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            raise ConnectorError(f"{what}: cannot resolve afd.host={host!r}: {exc}") from exc
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(socket.SOMAXCONN)
        except OSError as exc:
            listener.close()
            raise ConnectorError(f"{what}: cannot listen on {host}:{port} for the TCPStore: {exc}") from exc
        listen_fd = listener.detach()
    try:
        return dist.TCPStore(
            host, port, world_size, is_master, timeout=timeout, wait_for_workers=True, master_listen_fd=listen_fd
        )
    except (RuntimeError, dist.DistStoreError) as exc:  # the store owns listen_fd from the call on, and closed it
        raise PeerLostError(
            f"{what}: TCPStore rendezvous of {world_size} ranks at {host}:{port} failed within {timeout_s:g}s: {exc}"
        ) from exc


def _gloo_address(host: str, port: int, interface: str | None) -> tuple[dict[str, str], str]:
    """``create_device`` keywords for Gloo, and a description of them: ``GLOO_SOCKET_IFNAME``, else
    ``interface``, else the address that routes to ``host``."""
    env = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if env or interface:
        name = env or str(interface)
        return {"interface": name}, f"interface {name} ({'GLOO_SOCKET_IFNAME' if env else 'afd.interface'})"
    address = route_source(host, port)
    return {"hostname": address}, f"{address} (the route to afd.host={host})"


def _nccl_interface(host: str, port: int, interface: str | None) -> None:
    """NCCL reads its socket interface from ``NCCL_SOCKET_IFNAME``; set it (when unset) to the one that routes
    to ``host`` so NCCL's bootstrap does not pick another."""
    if os.environ.get("NCCL_SOCKET_IFNAME"):
        return
    name = interface or interface_of(route_source(host, port))
    if name is not None:
        os.environ["NCCL_SOCKET_IFNAME"] = f"={name}"


def stage_groups(
    store: Any,
    prefix: str,
    rank: int,
    size: int,
    backend: str,
    timeout_s: float,
    num_stages: int,
    *,
    host: str,
    port: int,
    interface: str | None = None,
) -> list[Any]:
    """One ``ProcessGroupGloo`` (``backend="gloo"``) or ``ProcessGroupNCCL`` per stage, on ``store``.

    Sockets bind the interface that reaches ``host:port`` (``afd.host``) unless
    ``interface`` or the backend's ``*_SOCKET_IFNAME`` says otherwise. A group
    that cannot form is ``PeerLostError`` naming the address used.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    groups = []
    where, devices = "", []
    if backend == "gloo":
        device_kwargs, where = _gloo_address(host, port, interface)
        try:  # a device per group, as torch's own groups have: concurrent stage threads share no event loop
            devices = [dist.ProcessGroupGloo.create_device(**device_kwargs) for _ in range(num_stages)]
        except RuntimeError as exc:  # a bad interface is the deployment's error, not a lost peer
            raise ConnectorError(f"Gloo cannot use {where}: {exc}") from exc
    else:
        _nccl_interface(host, port, interface)
    try:
        for s in range(num_stages):
            prefixed = dist.PrefixStore(f"{prefix}/stage{s}", store)
            if backend == "gloo":
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = timeout
                opts._devices = [devices[s]]
                groups.append(dist.ProcessGroupGloo(prefixed, rank, size, opts))
            else:
                nccl_opts = dist.ProcessGroupNCCL.Options()
                nccl_opts._timeout = timeout
                groups.append(dist.ProcessGroupNCCL(prefixed, rank, size, nccl_opts))
    except (RuntimeError, dist.DistError) as exc:
        shutdown_groups(groups, prefix)
        via = f" on {where}" if where else ""
        raise PeerLostError(
            f"{backend} process group {prefix} (rank {rank} of {size}) could not form{via} within {timeout_s:g}s: {exc}"
        ) from exc
    return groups


def shutdown_groups(groups: Sequence[Any], owner: str) -> None:
    """Shut every group down; a group whose peer died cannot, and dropping it frees it."""
    for pg in groups:
        shutdown = getattr(pg, "shutdown", None)
        if shutdown is None:
            continue
        try:
            shutdown()
        except RuntimeError as exc:
            logger.debug("%s: process group shutdown failed: %s", owner, exc)


@functools.lru_cache(maxsize=16)
def _timedelta(seconds: float) -> datetime.timedelta:
    """One ``timedelta`` per timeout value: building one costs a microsecond per wait on the hot path."""
    return datetime.timedelta(seconds=seconds)


def wait_works(works: Sequence[Any], timeout_s: float, what: str, *what_args: object) -> None:
    """Wait for every work handle; a failure or timeout is ``PeerLostError`` naming ``what``.

    With ``what_args``, ``what`` is a %-format string formatted only on failure: a data path calls this per
    layer and formats nothing while the works complete.
    """
    timeout = _timedelta(timeout_s)
    for work in works:
        try:
            work.wait(timeout)
        except RuntimeError as exc:
            raise work_failed(exc, timeout_s, what, *what_args) from exc


def work_failed(exc: RuntimeError, timeout_s: float, what: str, *what_args: object) -> PeerLostError:
    """The ``PeerLostError`` for a work handle whose ``wait`` raised ``exc``: what failed, after how long, why."""
    text = what % what_args if what_args else what
    return PeerLostError(f"{text} failed or timed out after {timeout_s:g}s: {exc}")
