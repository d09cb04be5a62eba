"""NIXL glue shared by the connector and its raw baseline: one agent, registered regions, one-sided writes, mail.

NIXL moves bytes one-sidedly: the writer names a registered region of the
peer and writes into it; a short notification travels after the data, so
the reader learns from the notification that the bytes are there. This module
wraps what both the connector and ``afd bench connector``'s raw NIXL loop need:

* :class:`Agent` — a ``nixl_agent`` with the progress thread off (an idle
  agent with it on burned 50-80 % of a core), one lock around every call
  into it (stage threads share it), registered regions, cached write
  requests (steady-state decode repeats the same sizes), and a mailbox that
  sorts incoming notifications by (peer, stage).
* :class:`AgentInfo` — what a peer needs to write to us: agent metadata and
  regions, encoded with msgspec (NIXL's own descriptor serialisation pickles;
  nothing pickled travels here).
* :func:`poll` — the wait loop every wait uses: spin briefly, then sleep
  with back-off; a deadline and a liveness check every few milliseconds.

Pitfalls this module handles (measured with nixl-cu12 1.5.1): ``add_remote_agent``
returns the peer's name as bytes while notifications are keyed by str (a bytes
name never matches); a notification leaves only when the writer drives its
request to DONE, so every write here is driven to completion before the call
returns; with the progress thread off a waiting side must keep calling into
NIXL (the poll loop does), or the writer's request never completes.
"""

from __future__ import annotations

import collections
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch

from afd_sdk.errors import ConnectorError, PeerLostError, WireFormatError

__all__ = ["NOTIFY", "Agent", "AgentInfo", "Region", "nixl_api", "poll"]

#: notification body: magic, layer, stage, tokens (fixed binary, 16 bytes); with ``_OFFSET_MAGIC``:
#: magic, step (mod 2**32), stage, the first row this attention rank writes in its FFN rank's fan-in region
NOTIFY = struct.Struct("<4sIII")
_MAGIC = b"AFD1"
_OFFSET_MAGIC = b"AFDO"
#: how long a wait spins (yielding the core) before it starts to sleep, and the longest sleep between polls.
#: With the progress thread off, a sleeping side also delays the peer's writes into it (UCX progresses them
#: when this side calls in), so a short spin costs a round trip far more than its CPU: 100 µs made a 64 KiB
#: round trip 7× raw NIXL's; 2 ms brings it within 3× while an idle FFN rank stays under 5 % of a core.
SPIN_S = 2e-3
MAX_SLEEP_S = 1e-3
#: a wait this long is an idle peer, not a slow exchange: it sleeps up to IDLE_SLEEP_S between polls
IDLE_AFTER_S = 0.05
IDLE_SLEEP_S = 5e-3
#: how often a wait asks the control plane whether the peer is still there
ALIVE_EVERY_S = 0.02
#: cached write requests per agent (one per distinct (peer, regions, sizes) in steady state)
MAX_CACHED_WRITES = 256

INSTALL_HINT = "pip install afd-connector-nixl (it pins nixl-cu12==1.5.1; never the `nixl` meta package)"


#: NIXL's Python modules, by wheel: nixl-cu12 (CUDA 12 builds; runs on the CPU too), nixl-cu13 (CUDA 13)
NIXL_MODULES = ("nixl_cu12", "nixl_cu13")


def nixl_api() -> Any:
    """NIXL's ``_api`` module from the first wheel installed, or ``ConnectorError`` saying how to install one."""
    import importlib

    errors = []
    for module in NIXL_MODULES:
        try:
            return importlib.import_module(f"{module}._api")
        except ImportError as exc:
            errors.append(f"{module}: {exc}")
    raise ConnectorError(f"NixlAFDConnector needs NIXL, which does not import here ({'; '.join(errors)}); "
                         f"{INSTALL_HINT}")  # fmt: skip


class Region(msgspec.Struct, frozen=True, array_like=True):
    """One registered buffer as a peer addresses it."""

    addr: int
    nbytes: int
    device: int
    mem_type: str  # "DRAM" or "VRAM"


class AgentInfo(msgspec.Struct, frozen=True):
    """What a peer needs to write into this side: its NIXL agent metadata and its named regions."""

    name: str
    metadata: bytes
    regions: dict[str, Region]


def _mem_type(t: torch.Tensor) -> str:
    return "VRAM" if t.device.type == "cuda" else "DRAM"


#: NIXL binding errors that mean the peer is gone (its process died or the path to it broke)
_PEER_GONE = ("nixlRemoteDisconnectError", "nixlBackendError")


def _translated(exc: Exception, what: str) -> Exception:
    """Our exception for a NIXL binding error raised during ``what``: the peer lost, or a connector error."""
    if isinstance(exc, (PeerLostError, ConnectorError)):
        return exc
    kind = type(exc).__name__
    if kind in _PEER_GONE:
        return PeerLostError(f"NIXL {what}: the peer disconnected ({kind}: {exc})")
    return ConnectorError(f"NIXL {what} failed: {kind}: {exc}")


def poll(done: Callable[[], bool], deadline: float, alive: Callable[[], None], what: Callable[[], str],
         spin_s: float = SPIN_S) -> None:  # fmt: skip
    """Call ``done`` until it is true: spin ``spin_s`` (yielding), then sleep with back-off up to ``MAX_SLEEP_S``
    (``IDLE_SLEEP_S`` once the wait has lasted ``IDLE_AFTER_S``).

    Every ``ALIVE_EVERY_S`` ``alive()`` may raise ``PeerLostError``; past
    ``deadline`` (monotonic) this raises ``PeerLostError`` naming ``what()``.
    """
    if done():
        return
    now = time.monotonic()
    spin_until, next_alive, idle_at, sleep, cap = (
        now + spin_s,
        now + ALIVE_EVERY_S,
        now + IDLE_AFTER_S,
        20e-6,
        MAX_SLEEP_S,
    )
    while not done():
        now = time.monotonic()
        if now >= next_alive:
            alive()
            next_alive = now + ALIVE_EVERY_S
        if now >= deadline:
            raise PeerLostError(f"no {what()} before the deadline")
        if now < spin_until:
            os.sched_yield()
        else:
            time.sleep(sleep)
            if now >= idle_at:
                cap = IDLE_SLEEP_S
            sleep = min(sleep * 2, cap)


class Agent:
    """One NIXL agent of this process (UCX backend, progress thread off); every call holds one lock."""

    def __init__(self, name: str, *, spin_s: float = SPIN_S) -> None:
        api = nixl_api()
        self.spin_s = spin_s
        config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"])
        try:
            self.agent = api.nixl_agent(name, config)
        except Exception as exc:  # NIXL raises plain RuntimeError / nixlBind errors
            raise ConnectorError(f"NIXL agent {name!r} could not start: {exc}") from exc
        if "UCX" not in self.agent.backends:
            raise ConnectorError(f"NIXL agent {name!r} has no UCX backend (plugins: {self.agent.plugin_list})")
        self.name = name
        self.lock = threading.Lock()
        self._registered: list[Any] = []
        self._peers: list[str] = []
        self._writes: collections.OrderedDict[tuple[Any, ...], Any] = collections.OrderedDict()
        self._mail: dict[tuple[str, int], collections.deque[tuple[int, int]]] = collections.defaultdict(
            collections.deque
        )
        self._offsets: dict[tuple[str, int], collections.deque[tuple[int, int]]] = collections.defaultdict(
            collections.deque
        )

    # --- set-up -------------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> Region:
        """Register ``tensor``'s memory once (kept registered until :meth:`close`); its region for peers."""
        with self.lock:
            self._registered.append(self.agent.register_memory([tensor]))
        return Region(tensor.data_ptr(), tensor.nbytes, tensor.device.index or 0, _mem_type(tensor))

    def info(self, regions: dict[str, Region]) -> bytes:
        """This agent's metadata and ``regions``, encoded for a peer (after every region is registered)."""
        with self.lock:
            metadata = self.agent.get_agent_metadata()
        return msgspec.msgpack.encode(AgentInfo(self.name, metadata, regions))

    def add_peer(self, blob: bytes) -> AgentInfo:
        """Load a peer's :meth:`info` and connect to it now (the first write would pay the connection otherwise)."""
        try:
            info = msgspec.msgpack.decode(blob, type=AgentInfo)
        except msgspec.DecodeError as exc:
            raise WireFormatError(f"NIXL peer info is malformed: {exc}") from None
        with self.lock:
            try:
                loaded = self.agent.add_remote_agent(info.metadata)
            except Exception as exc:
                raise _translated(exc, f"loading peer {info.name!r}") from exc
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != info.name:
                raise WireFormatError(f"NIXL peer announced agent {info.name!r} but its metadata names {name!r}")
            self._peers.append(name)
            try:
                self.agent.make_connection(name)
            except Exception as exc:
                raise _translated(exc, f"connecting to {name!r}") from exc
        return info

    # --- data path ----------------------------------------------------------------

    def write(self, peer: str, pieces: Sequence[tuple[Region, int, Region, int, int]], note: bytes) -> Any:
        """Post one WRITE of ``pieces`` (local region, offset, remote region, offset, bytes) with ``note``.

        Returns the request for :meth:`complete`. Requests are cached by
        their pieces and reused (a request is re-posted only after it completed).
        """
        key = (peer, tuple(pieces))
        with self.lock:
            try:
                handle = self._writes.get(key)
                if handle is None:
                    handle = self._new_write(peer, pieces)
                    self._writes[key] = handle
                    if len(self._writes) > MAX_CACHED_WRITES:
                        _, old = self._writes.popitem(last=False)
                        old.release()
                else:
                    self._writes.move_to_end(key)
                state = self.agent.transfer(handle, note)
            except Exception as exc:
                raise _translated(exc, f"write to {peer}") from exc
        if state == "ERR":
            raise PeerLostError(f"NIXL write to {peer} failed when posted")
        return handle

    def write_from(self, peer: str, sources: Sequence[tuple[torch.Tensor, Region, int]], note: bytes
                   ) -> tuple[Any, Any]:  # fmt: skip
        """Post one WRITE straight from ``sources`` (contiguous tensor, remote region, offset): no staging copy.

        The tensors are registered for this one write; pass the returned
        ``(request, registration)`` to :meth:`release_from` once the write
        completed. Registering costs about 20 µs, so it pays from a few hundred
        KiB on (a copy into a registered region is cheaper below).
        """
        tensors = [t for t, _, _ in sources]
        with self.lock:
            try:
                reg = self.agent.register_memory(tensors)
            except Exception as exc:
                raise _translated(exc, f"registering a write to {peer}") from exc
            try:
                local = self.agent.get_xfer_descs(tensors)
                mem = sources[0][1].mem_type
                remote = self.agent.get_xfer_descs([(r.addr + off, t.nbytes, r.device) for t, r, off in sources], mem)
                handle = self.agent.initialize_xfer("WRITE", local, remote, peer)
                state = self.agent.transfer(handle, note)
            except Exception as exc:
                self.agent.deregister_memory(reg)
                raise _translated(exc, f"write to {peer}") from exc
        if state == "ERR":
            self.release_from(handle, reg)
            raise PeerLostError(f"NIXL write to {peer} failed when posted")
        return handle, reg

    def release_from(self, handle: Any, reg: Any) -> None:
        """Release a :meth:`write_from` request and its registration (after it completed or failed)."""
        with self.lock:
            handle.release()
            self.agent.deregister_memory(reg)

    def _new_write(self, peer: str, pieces: Sequence[tuple[Region, int, Region, int, int]]) -> Any:
        mem = pieces[0][0].mem_type
        local = self.agent.get_xfer_descs([(lr.addr + lo, n, lr.device) for lr, lo, _, _, n in pieces], mem)
        remote = self.agent.get_xfer_descs([(rr.addr + ro, n, rr.device) for _, _, rr, ro, n in pieces],
                                           pieces[0][2].mem_type)  # fmt: skip
        return self.agent.initialize_xfer("WRITE", local, remote, peer)

    def complete(self, handles: Sequence[Any], deadline: float, alive: Callable[[], None],
                 what: Callable[[], str]) -> None:  # fmt: skip
        """Drive ``handles`` to DONE (their notifications leave then); ``PeerLostError`` on error or deadline."""
        pending = list(handles)

        def done() -> bool:
            with self.lock:
                try:
                    states = [self.agent.check_xfer_state(h) for h in pending]
                except Exception as exc:
                    raise _translated(exc, what()) from exc
            if "ERR" in states:
                raise PeerLostError(f"NIXL {what()} failed (the peer is gone or unreachable)")
            pending[:] = [h for h, s in zip(pending, states, strict=True) if s != "DONE"]
            return not pending

        poll(done, deadline, alive, lambda: f"completion of {what()} within the exchange deadline", self.spin_s)

    def notify(self, peer: str, note: bytes) -> None:
        """A notification without data (a zero-token exchange keeps the peers in lockstep)."""
        with self.lock:
            try:
                self.agent.send_notif(peer, note)
            except Exception as exc:
                raise _translated(exc, f"notification to {peer}") from exc

    def receive(self, peer: str, stage: int, deadline: float, alive: Callable[[], None],
                what: Callable[[], str]) -> tuple[int, int]:  # fmt: skip
        """Wait for ``peer``'s next notification on ``stage``: its ``(layer, tokens)``."""
        return self._wait_box(self._mail[(peer, stage)], deadline, alive, what)

    def receive_offset(self, peer: str, stage: int, deadline: float, alive: Callable[[], None],
                       what: Callable[[], str]) -> tuple[int, int]:  # fmt: skip
        """Wait for ``peer``'s next row-offset notification on ``stage``: its ``(step mod 2**32, first row)``."""
        return self._wait_box(self._offsets[(peer, stage)], deadline, alive, what)

    def _wait_box(self, box: collections.deque[tuple[int, int]], deadline: float, alive: Callable[[], None],
                  what: Callable[[], str]) -> tuple[int, int]:  # fmt: skip
        def done() -> bool:
            if box:
                return True
            self._pump()
            return bool(box)

        poll(done, deadline, alive, what, self.spin_s)
        return box.popleft()

    def _pump(self) -> None:
        with self.lock:
            try:
                new = self.agent.get_new_notifs()
            except Exception as exc:
                raise _translated(exc, "receiving notifications") from exc
        for peer, notes in new.items():
            for note in notes:
                magic = note[:4]
                if len(note) != NOTIFY.size or magic not in (_MAGIC, _OFFSET_MAGIC):
                    raise WireFormatError(f"NIXL notification from {peer!r} is not an afd-sdk one: {note[:32]!r}")
                _, first, stage, second = NOTIFY.unpack(note)
                box = self._mail if magic == _MAGIC else self._offsets
                box[(peer, stage)].append((first, second))

    @staticmethod
    def note(layer: int, stage: int, tokens: int) -> bytes:
        return NOTIFY.pack(_MAGIC, layer, stage, tokens)

    @staticmethod
    def offset_note(step: int, stage: int, row: int) -> bytes:
        """Tell an attention rank the first row of its tokens in the fan-in region of ``stage`` for ``step``."""
        return NOTIFY.pack(_OFFSET_MAGIC, step & 0xFFFFFFFF, stage, row)

    # --- teardown -----------------------------------------------------------------

    def close(self) -> None:
        """Release cached requests, forget the peers, deregister every region. Idempotent."""
        with self.lock:
            writes, self._writes = list(self._writes.values()), collections.OrderedDict()
            for h in writes:
                h.release()
            peers, self._peers = self._peers, []
            for name in peers:
                self.agent.remove_remote_agent(name)
            regs, self._registered = self._registered, []
            for reg in regs:
                self.agent.deregister_memory(reg)
            self._mail.clear()
            self._offsets.clear()
