"""NIXL glue shared by the connector and its raw baseline: one agent, registered regions, one-sided writes, mail.

NIXL moves bytes one-sidedly: the writer names a registered region of the
peer and writes into it; a short notification travels after the data, so
the reader learns from the notification that the bytes are there. This module
wraps what both the connector and ``afd bench connector``'s raw NIXL loop need:

* :class:`Agent` — a ``nixl_agent`` with the progress thread off (an idle
  agent with it on burned 50-80 % of a core), one lock around every call
  into it (stage threads share it), registered regions, cached write
  requests (steady-state decode repeats the same sizes), registered
  *sources* (memory a write may start from without a staging copy: the
  agent's own regions, and any tensor storage seen twice while alive), and a
  mailbox that sorts incoming notifications by (peer, stage).
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
import weakref
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
#: live storages registered as write sources after a second sighting (static buffers: the same few every layer);
#: beyond it a repeated storage is staged like a fresh one until a registered one dies
MAX_SOURCES = 64
#: storages remembered as seen once, awaiting a second sighting
MAX_SEEN = 256

INSTALL_HINT = "pip install afd-connector-nixl (it pins nixl-cu12==1.5.1; never the `nixl` meta package)"


#: NIXL's Python modules, by wheel: nixl-cu12 (CUDA 12 builds; runs on the CPU too), nixl-cu13 (CUDA 13)
NIXL_MODULES = ("nixl_cu12", "nixl_cu13")


def nixl_api() -> Any:
    """NIXL's ``_api`` module from the first wheel installed, or ``ConnectorError`` saying how to install one."""
    import importlib

    errors = []
    for module in NIXL_MODULES:
        try:
            api = importlib.import_module(f"{module}._api")
        except ImportError as exc:
            errors.append(f"{module}: {exc}")
            continue
        _nixl_logs_to_stderr()
        return api
    raise ConnectorError(
        f"NixlAFDConnector needs NIXL, which does not import here ({'; '.join(errors)}); {INSTALL_HINT}"
    )


def _nixl_logs_to_stderr() -> None:
    """Point NIXL's log handlers at standard error: its Python package logs INFO lines ("Backend UCX was
    instantiated") to standard output, where they would corrupt a process's ``--json`` result."""
    import logging
    import sys

    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


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
    #: the rows per attention peer its receive regions hold (its max_num_tokens): peers write at offsets of that
    #: layout, whatever their own max_num_tokens (0: a peer that does not say, read as the same as the reader's)
    max_num_tokens: int = 0


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


def poll(
    done: Callable[[], bool],
    deadline: float,
    alive: Callable[[str], None],
    spin_s: float,
    what: str,
    *what_args: object,
) -> None:
    """Call ``done`` until it is true: spin ``spin_s`` (yielding), then sleep with back-off up to ``MAX_SLEEP_S``
    (``IDLE_SLEEP_S`` once the wait has lasted ``IDLE_AFTER_S``).

    ``what % what_args`` names the awaited event in errors; it is formatted
    only then (the hot path builds no string). Every ``ALIVE_EVERY_S``
    ``alive(awaited)`` may raise ``PeerLostError``; past ``deadline``
    (monotonic) this raises ``PeerLostError`` naming it.
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
            alive(what % what_args)
            next_alive = now + ALIVE_EVERY_S
        if now >= deadline:
            raise PeerLostError(f"no {what % what_args} before the deadline")
        if now < spin_until:
            os.sched_yield()
        else:
            time.sleep(sleep)
            if now >= idle_at:
                cap = IDLE_SLEEP_S
            sleep = min(sleep * 2, cap)


class _Source:
    """A registered storage that writes may start from: its region, its NIXL registration, a weak reference."""

    __slots__ = ("own", "ref", "reg", "region")

    def __init__(self, ref: weakref.ref[Any], region: Region, reg: Any, own: bool) -> None:
        self.ref, self.region, self.reg, self.own = ref, region, reg, own


Piece = tuple[Region, int, Region, int, int]  # local region, offset, remote region, offset, bytes


class Agent:
    """One NIXL agent of this process (UCX backend, progress thread off); every call holds one lock."""

    def __init__(self, name: str, *, spin_s: float = SPIN_S, register_sources: bool = True) -> None:
        api = nixl_api()
        self.spin_s = spin_s
        #: whether :meth:`source` registers a storage seen twice (off: only this agent's own regions are sources)
        self.register_sources = register_sources
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
        self._writes: dict[tuple[Any, ...], Any] = {}
        #: cached requests posted and not yet seen finished by :meth:`complete` (never evicted)
        self._busy: set[Any] = set()
        #: id(storage) -> the registered storage writes may start from (own regions and repeated sources)
        self._sources: dict[int, _Source] = {}
        #: id(storage) -> storages seen once as a write's source, awaiting a second sighting
        self._seen: dict[int, weakref.ref[Any]] = {}
        #: ids of registered sources whose storage died (weakref callbacks append; :meth:`_reap` deregisters)
        self._dead: list[int] = []
        #: bumped whenever a source is deregistered: a request cached outside the agent is valid for one generation
        self.generation = 0
        self._mail: dict[tuple[str, int], collections.deque[tuple[int, int]]] = collections.defaultdict(
            collections.deque
        )
        self._offsets: dict[tuple[str, int], collections.deque[tuple[int, int]]] = collections.defaultdict(
            collections.deque
        )

    # --- set-up -------------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> Region:
        """Register ``tensor``'s memory once (kept registered until :meth:`close`); its region for peers.

        The caller keeps ``tensor`` alive until :meth:`close`. A write may start
        from anywhere in it without a staging copy (:meth:`source`).
        """
        region = Region(tensor.data_ptr(), tensor.nbytes, tensor.device.index or 0, _mem_type(tensor))
        with self.lock:
            reg = self.agent.register_memory([tensor])
            self._registered.append(reg)
            storage = tensor.untyped_storage()
            if storage.data_ptr() == region.addr and storage.nbytes() == region.nbytes:
                self._sources[id(storage)] = _Source(weakref.ref(storage), region, None, True)
        return region

    def info(self, regions: dict[str, Region], max_num_tokens: int = 0) -> bytes:
        """This agent's metadata, ``regions`` and their rows per peer (0: no row layout, the raw baseline's),
        encoded for a peer (after every region is registered)."""
        with self.lock:
            metadata = self.agent.get_agent_metadata()
        return msgspec.msgpack.encode(AgentInfo(self.name, metadata, regions, max_num_tokens))

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

    # --- write sources --------------------------------------------------------------

    def source(self, tensor: torch.Tensor) -> Region | None:
        """The registered region that holds ``tensor``'s storage, or ``None``: then the caller stages a copy.

        Called by the connector for every tensor it sends. A storage seen
        for the second time while still alive is registered here and stays
        registered while it lives (up to ``MAX_SOURCES``): static buffers (a
        model's preallocated activations, CUDA-graph pools, the FFN's receive
        region echoed back) are written from in place, while a model that
        allocates fresh hidden states every layer pays one copy and never a
        registration. When a storage dies its registration is dropped, with
        every cached request that reads from it, before the next write. With
        ``MAX_SOURCES`` live sources registered, further storages are staged.
        """
        if self._dead:
            self._reap()
        storage = tensor.untyped_storage()
        key = id(storage)
        src = self._sources.get(key)
        if src is not None and src.ref() is storage and src.region.addr == storage.data_ptr():
            return src.region
        if not self.register_sources:
            return None
        seen = self._seen.get(key)
        if seen is None or seen() is not storage:
            if len(self._seen) >= MAX_SEEN:
                self._seen.clear()
            self._seen[key] = weakref.ref(storage)
            return None
        self._seen.pop(key, None)  # another stage thread may have taken it meanwhile
        return self._register_source(storage, tensor.device)

    def _register_source(self, storage: Any, device: torch.device) -> Region | None:
        """Register ``storage`` as a source; ``None`` (stage a copy) while ``MAX_SOURCES`` live ones are registered.

        A live source is never evicted: another stage thread may be writing from it. Dead ones free their slots.
        """
        addr, nbytes = storage.data_ptr(), storage.nbytes()
        region = Region(addr, nbytes, device.index or 0, "VRAM" if device.type == "cuda" else "DRAM")
        with self.lock:
            known = self._sources.get(id(storage))
            if known is not None and known.ref() is storage:  # another stage thread registered it meanwhile
                return known.region
            if known is not None and not known.own:  # a dead storage under the same id, not reaped yet
                self._drop_source(id(storage))
            if sum(not s.own for s in self._sources.values()) >= MAX_SOURCES:
                return None
            try:
                reg = self.agent.register_memory([(addr, nbytes, region.device, "")], region.mem_type)
            except Exception as exc:
                raise _translated(exc, f"registering a {nbytes}-byte source") from exc
            dead = self._dead
            ref = weakref.ref(storage, lambda _ref, key=id(storage): dead.append(key))
            self._sources[id(storage)] = _Source(ref, region, reg, False)
        return region

    def _reap(self) -> None:
        """Deregister the sources whose storage died since the last call (weakref callbacks queued them)."""
        with self.lock:
            while self._dead:
                key = self._dead.pop()
                src = self._sources.get(key)
                if src is not None and src.ref() is None:
                    self._drop_source(key)

    def _drop_source(self, key: int) -> None:
        """Under the lock: release the cached requests reading from source ``key``, then its registration."""
        src = self._sources.pop(key)
        lo, hi = src.region.addr, src.region.addr + src.region.nbytes
        for wkey in [k for k in self._writes if any(lo <= addr < hi for addr, _, _ in k[1])]:
            handle = self._writes.pop(wkey)
            self._busy.discard(handle)
            handle.release()
        self.agent.deregister_memory(src.reg)
        self.generation += 1

    # --- data path ----------------------------------------------------------------

    def write(self, peer: str, pieces: Sequence[Piece], note: bytes) -> Any:
        """Post one WRITE of ``pieces`` (local region, offset, remote region, offset, bytes) with ``note``.

        Returns the request; drive it with :meth:`complete`. Requests are made
        once per distinct pieces and reused; one made from a repeated source
        (:meth:`source`) is released when that source dies.
        """
        key = (peer, tuple((lr.addr + lo, rr.addr + ro, n) for lr, lo, rr, ro, n in pieces))
        return self._post(key, peer, pieces, note)

    def write_one(
        self, peer: str, local: Region, at: int, remote: Region, remote_at: int, nbytes: int, note: bytes
    ) -> Any:
        """:meth:`write` of one piece, without building the pieces (the steady state's single-tensor write)."""
        return self._post(
            (peer, ((local.addr + at, remote.addr + remote_at, nbytes),)),
            peer,
            ((local, at, remote, remote_at, nbytes),),
            note,
        )

    def _post(self, key: tuple[Any, ...], peer: str, pieces: Sequence[Piece], note: bytes) -> Any:
        """Under the lock: the cached request for ``key`` (made on a miss), marked busy until
        :meth:`complete` saw it finish, then posted. A busy request is never evicted."""
        with self.lock:
            handle = self._writes.get(key)
            try:
                if handle is None:
                    handle = self._new_request(key, peer, pieces)
                state = self.agent.transfer(handle, note)
            except Exception as exc:
                raise _translated(exc, f"write to {peer}") from exc
            self._busy.add(handle)
        if state == "ERR":
            raise PeerLostError(f"NIXL write to {peer} failed when posted")
        return handle

    def _new_request(self, key: tuple[Any, ...], peer: str, pieces: Sequence[Piece]) -> Any:
        """Under the lock: prepare and cache the request for ``key``, evicting idle ones when the cache is full."""
        mem = pieces[0][0].mem_type
        local = self.agent.get_xfer_descs([(lr.addr + lo, n, lr.device) for lr, lo, _, _, n in pieces], mem)
        remote = self.agent.get_xfer_descs(
            [(rr.addr + ro, n, rr.device) for _, _, rr, ro, n in pieces], pieces[0][2].mem_type
        )
        handle = self.agent.initialize_xfer("WRITE", local, remote, peer)
        if len(self._writes) >= MAX_CACHED_WRITES:  # token counts vary while serving: drop the oldest idle half
            for old in [k for k in self._writes if self._writes[k] not in self._busy][: MAX_CACHED_WRITES // 2]:
                self._writes.pop(old).release()
        self._writes[key] = handle
        return handle

    def write_from(
        self, peer: str, sources: Sequence[tuple[torch.Tensor, Region, int]], note: bytes
    ) -> tuple[Any, Any]:
        """Post one WRITE straight from ``sources`` (contiguous tensor, remote region, offset): no staging copy.

        The tensors are registered for this one write; pass the returned
        ``(request, registration)`` to :meth:`release_from` once the write
        completed. Registering, preparing and releasing cost more than
        copying a few hundred KiB, so this pays only for large fresh tensors.
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

    def complete(
        self, handles: Sequence[Any], deadline: float, alive: Callable[[str], None], what: str, *what_args: object
    ) -> None:
        """Drive ``handles`` to DONE (their notifications leave then); ``PeerLostError`` on error or deadline.

        ``what % what_args`` names the writes in errors (formatted only then).
        """
        if len(handles) == 1:  # the steady state: one write, often already done when first asked
            handle = handles[0]
            with self.lock:
                try:
                    state = self.agent.check_xfer_state(handle)
                except Exception as exc:
                    self._busy.discard(handle)
                    raise _translated(exc, what % what_args) from exc
                if state == "DONE":
                    self._busy.discard(handle)
                    return
        try:
            self._wait_done(handles, deadline, alive, what, what_args)
        finally:
            with self.lock:
                self._busy.difference_update(handles)

    def _wait_done(
        self,
        handles: Sequence[Any],
        deadline: float,
        alive: Callable[[str], None],
        what: str,
        what_args: tuple[object, ...],
    ) -> None:
        pending = list(handles)

        def done() -> bool:
            with self.lock:
                try:
                    states = [self.agent.check_xfer_state(h) for h in pending]
                except Exception as exc:
                    raise _translated(exc, what % what_args) from exc
            if "ERR" in states:
                raise PeerLostError(f"NIXL {what % what_args} failed (the peer is gone or unreachable)")
            pending[:] = [h for h, s in zip(pending, states, strict=True) if s != "DONE"]
            return not pending

        poll(done, deadline, alive, self.spin_s, "completion of %s within the exchange deadline", what % what_args)

    def notify(self, peer: str, note: bytes) -> None:
        """A notification without data (a zero-token exchange keeps the peers in lockstep)."""
        with self.lock:
            try:
                self.agent.send_notif(peer, note)
            except Exception as exc:
                raise _translated(exc, f"notification to {peer}") from exc

    def receive(
        self, peer: str, stage: int, deadline: float, alive: Callable[[str], None], what: str, *what_args: object
    ) -> tuple[int, int]:
        """Wait for ``peer``'s next notification on ``stage``: its ``(layer, tokens)``."""
        return self._wait_box(self._mail[(peer, stage)], deadline, alive, what, what_args)

    def receive_offset(
        self, peer: str, stage: int, deadline: float, alive: Callable[[str], None], what: str, *what_args: object
    ) -> tuple[int, int]:
        """Wait for ``peer``'s next row-offset notification on ``stage``: its ``(step mod 2**32, first row)``."""
        return self._wait_box(self._offsets[(peer, stage)], deadline, alive, what, what_args)

    def _wait_box(
        self,
        box: collections.deque[tuple[int, int]],
        deadline: float,
        alive: Callable[[str], None],
        what: str,
        what_args: tuple[object, ...],
    ) -> tuple[int, int]:
        if not box:
            self._pump()
            if not box:

                def done() -> bool:
                    self._pump()
                    return bool(box)

                poll(done, deadline, alive, self.spin_s, what, *what_args)
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
        """Release cached requests, forget the peers, deregister every region and source. Idempotent."""
        with self.lock:
            writes, self._writes = list(self._writes.values()), {}
            self._busy.clear()
            for h in writes:
                h.release()
            peers, self._peers = self._peers, []
            for name in peers:
                self.agent.remove_remote_agent(name)
            sources, self._sources = list(self._sources.values()), {}
            for src in sources:
                if not src.own:
                    self.agent.deregister_memory(src.reg)
            self._seen.clear()
            self._dead.clear()
            self.generation += 1
            regs, self._registered = self._registered, []
            for reg in regs:
                self.agent.deregister_memory(reg)
            self._mail.clear()
            self._offsets.clear()
