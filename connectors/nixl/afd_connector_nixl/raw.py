"""Raw NIXL under ``NixlAFDConnector``: the same WRITE + notification round trip without the connector.

``afd bench connector --connector nixl`` measures the connector against this
loop in the same processes (declared in ``NixlAFDConnector.raw_baselines``):
the attention side writes a registered payload into the FFN side's region
with a notification; the FFN side waits for it and writes the bytes back
with one. No staging copy, no checks, no control plane: what is left is
NIXL itself, through the same :class:`~afd_connector_nixl.agent.Agent` and
wait loop as the connector.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from afd_connector_nixl.agent import Agent, Region
from afd_sdk.control import open_tcp_store

__all__ = ["RawNixl"]


class RawNixl:
    """One side of the raw NIXL round trip (constructed as the benchmark constructs every raw transport)."""

    def __init__(self, role: str, *, host: str, port: int, max_bytes: int, timeout_s: float) -> None:
        self.role = role
        self.timeout_s = timeout_s
        me, peer = ("ffn", "attention") if role == "ffn" else ("attention", "ffn")
        self.agent = Agent(f"afd-nixl-raw-{port}-{me}")  # the connector's default spin
        self.region = torch.empty(max_bytes, dtype=torch.uint8)
        self.local: Region = self.agent.register(self.region)
        self.store = open_tcp_store(host, port, 2, role == "ffn", timeout_s, "raw nixl")
        self.store.set(me, self.agent.info({"region": self.local}))
        info = self.agent.add_peer(self.store.get(peer))
        self.peer, self.remote = info.name, info.regions["region"]
        self._payloads: dict[tuple[int, int], Region] = {}

    def _alive(self, what: str) -> None:
        """The raw loop has no control plane: only the deadline bounds its waits."""

    def attention_round_trip(self, payload: torch.Tensor) -> Callable[[], None]:
        key = (payload.data_ptr(), payload.nbytes)
        src = self._payloads.get(key)
        if src is None:
            src = self._payloads[key] = self.agent.register(payload)
        agent, n, note, peer = self.agent, payload.nbytes, self.agent.note(0, 0, payload.nbytes), self.peer
        remote = self.remote

        def rt() -> None:
            deadline = time.monotonic() + self.timeout_s
            agent.complete((agent.write_one(peer, src, 0, remote, 0, n, note),), deadline, self._alive, "raw write")
            agent.receive(peer, 0, deadline, self._alive, "raw echo")

        return rt

    def ffn_echo(self, count: int, nbytes: int) -> None:
        agent, note, peer = self.agent, self.agent.note(0, 0, nbytes), self.peer
        local, remote = self.local, self.remote
        for _ in range(count):
            deadline = time.monotonic() + self.timeout_s
            agent.receive(peer, 0, deadline, self._alive, "raw payload")
            handle = agent.write_one(peer, local, 0, remote, 0, nbytes, note)
            agent.complete((handle,), deadline, self._alive, "raw echo write")

    def close(self) -> None:
        self.agent.close()
        self.store = None
