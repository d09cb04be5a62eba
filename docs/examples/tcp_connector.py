"""A complete AFD connector on plain TCP sockets, built on the public transport kit.

Only the data path is written here; rendezvous, handshake, step announcements,
heartbeats, goodbye and liveness come from :class:`afd_sdk.control.ZmqControlPlane`,
and the base class owns ``init``/``close``. ``docs/writing-a-connector.md``
walks through it; ``tests/test_conformance_catches_broken.py`` runs the shipped
suite on it.

Ports: the control plane binds ``afd.port + f`` for FFN rank ``f``; this
connector's data sockets listen at ``afd.port + F + f * S + s`` (stage ``s``).

``blocking_ffn_send=true`` makes ``send_ffn_output`` write inline: a deliberately
broken variant that deadlocks once payloads outgrow the kernel's socket buffers
with two interleaved stages. ``MemoisingTcpConnector`` is broken on purpose too:
it skips the send checks of a stage that passed them once. The conformance suite
must fail both.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import msgspec
import torch

from afd_sdk import A2FPayload, AFDConnector, ConnectorCapabilities, ConnectorContext, PeerLostError, TransferMetadata
from afd_sdk.control import ZmqControlPlane, tensor_bytes, writable_bytes
from afd_sdk.topology import FFNFirstWorld
from afd_sdk.wire import dtype_from_name

_HEADER = struct.Struct("<iiq")  # layer, stage, tokens
logger = logging.getLogger(__name__)


def _join_thread(t: threading.Thread, deadline: float) -> None:
    """Join ``t`` and wait for its OS thread to exit, so ``close()`` leaves exactly what ``open()`` found.

    ``Thread.join()`` returns when the Python thread state is gone, a moment
    before the OS thread itself exits (``/proc/self/task/<tid>`` still lists
    it); the conformance suite's leak check counts OS threads.
    """
    t.join(timeout=max(0.0, deadline - time.monotonic()))
    if t.is_alive():
        logger.warning("tcp connector: writer thread %s still blocked at close; its socket is closed next", t.name)
        return
    task = f"/proc/self/task/{t.native_id}"
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.0005)


class TcpExtraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    blocking_ffn_send: bool = False


class TcpAFDConnector(AFDConnector):
    """Hidden states over one TCP connection per (attention rank, stage)."""

    name = "TcpAFDConnector"
    capabilities: ClassVar[ConnectorCapabilities] = ConnectorCapabilities(devices=frozenset({"cpu"}))
    extra_config_schema = TcpExtraConfig

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self._socks: list[list[socket.socket]] = []  # stage -> sockets, one per peer in fan-in order
        self._senders: list[tuple[queue.Queue[Any], threading.Thread]] = []  # FFN: one writer thread per stage
        self._dtype = dtype_from_name(context.model.dtype)
        self._writer_error: PeerLostError | None = None  # raised by the next send_ffn_output

    # --- lifecycle: open / release (the base owns init / close) ----------------

    def _port(self, ffn_rank: int, stage: int) -> int:
        cfg = self.config
        return cfg.port + cfg.num_ffn_ranks + ffn_rank * cfg.num_stages + stage

    def open(self) -> None:
        cfg, world = self.config, self.world
        assert isinstance(world, FFNFirstWorld)
        control = ZmqControlPlane(self.context, connector_name=self.name)
        if self.role == "ffn":
            peers = world.attention_for_ffn(self.role_rank)
            listeners = [socket.create_server((cfg.host, self._port(self.role_rank, s))) for s in range(cfg.num_stages)]
            try:
                self.attach_control_plane(control)  # peers connect once the handshake passed
                for lst in listeners:
                    lst.settimeout(cfg.timeout_s)
                    by_rank: dict[int, socket.socket] = {}
                    while len(by_rank) < len(peers):
                        try:
                            conn, _ = lst.accept()
                        except TimeoutError as exc:
                            raise PeerLostError(f"attention peers did not connect within {cfg.timeout_s:g}s") from exc
                        by_rank[struct.unpack("<i", self._read_exact(conn, 4))[0]] = conn
                    self._socks.append([by_rank[a] for a in peers])
            finally:
                for lst in listeners:
                    lst.close()
            for _ in range(cfg.num_stages):
                q: queue.Queue[Any] = queue.Queue()
                t = threading.Thread(target=self._writer, args=(q,), daemon=True)
                t.start()
                self._senders.append((q, t))
        else:
            self.attach_control_plane(control)
            ffn = world.ffn_for_attention(self.role_rank)
            for s in range(cfg.num_stages):
                sock = socket.create_connection((cfg.host, self._port(ffn, s)), timeout=cfg.timeout_s)
                sock.sendall(struct.pack("<i", self.role_rank))
                self._socks.append([sock])
        for socks in self._socks:
            for sock in socks:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(cfg.timeout_s)  # every blocking read and write has a deadline

    def release(self) -> None:
        deadline = time.monotonic() + self.config.timeout_s
        for q, _ in self._senders:
            q.put(None)
        for _, t in self._senders:
            _join_thread(t, deadline)
        self._senders = []
        for socks in self._socks:
            for sock in socks:
                sock.close()
        self._socks = []

    # --- helpers ------------------------------------------------------------------

    def _read_exact(self, sock: socket.socket, n: int, into: memoryview | None = None) -> bytes | memoryview:
        buf = into if into is not None else memoryview(bytearray(n))
        got = 0
        while got < n:
            try:
                k = sock.recv_into(buf[got:], n - got)
            except TimeoutError as exc:
                raise PeerLostError(f"{self.name}: peer silent for {self.config.timeout_s:g}s") from exc
            except OSError as exc:  # connection reset: the peer process died
                raise PeerLostError(f"{self.name}: peer connection failed: {exc}") from exc
            if k == 0:
                raise PeerLostError(f"{self.name}: peer closed its connection")
            got += k
        return buf if into is not None else bytes(buf)

    def _write(self, sock: socket.socket, frames: list[bytes | memoryview]) -> None:
        try:
            for frame in frames:
                sock.sendall(frame)
        except (TimeoutError, OSError) as exc:
            raise PeerLostError(f"{self.name}: send failed: {exc}") from exc

    def _writer(self, q: queue.Queue[Any]) -> None:
        while (job := q.get()) is not None:
            sock, frames, _keepalive = job
            try:
                self._write(sock, frames)
            except PeerLostError as exc:
                self._writer_error = exc  # reported by the next send_ffn_output
                return

    def _tensor_specs(self, n: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        specs = [((n, self._hidden_size), self._dtype)]
        specs += [((n, *e.trailing_shape), dtype_from_name(e.dtype)) for e in self.context.ffn_extras]
        return specs

    # --- attention side -----------------------------------------------------------

    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.require_role("attention", "send_attn_output")
        self.check_stage(metadata.stage_idx)
        n = self.check_attn_send(hidden_states, metadata)
        self.check_no_send_pending(metadata.stage_idx)
        self._write_a2f(metadata, n, [hidden_states, *self.check_extras(extras, n)])

    def _write_a2f(self, metadata: TransferMetadata, n: int, tensors: list[torch.Tensor]) -> None:
        """Write one a2f message (header, then the tensors' bytes) and record the send."""
        header = _HEADER.pack(metadata.layer_idx, metadata.stage_idx, n)
        self._write(self._socks[metadata.stage_idx][0], [header, *map(tensor_bytes, tensors)])
        self.record_send(metadata, n)

    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        self.require_role("attention", "recv_ffn_output")
        self.check_stage(stage_idx)
        _layer, n = self.take_send(stage_idx)
        sock = self._socks[stage_idx][0]
        self._read_exact(sock, _HEADER.size)
        out = torch.empty(n, self._hidden_size, dtype=ref_tensor.dtype)
        if n:
            self._read_exact(sock, out.nbytes, writable_bytes(out))
        return out

    # --- ffn side --------------------------------------------------------------------

    def recv_attn_output(self, stage_idx: int = 0) -> A2FPayload:
        self.require_role("ffn", "recv_attn_output")
        self.check_stage(stage_idx)
        parts, counts, layer = [], [], 0
        for sock in self._socks[stage_idx]:
            layer, _stage, n = _HEADER.unpack(self._read_exact(sock, _HEADER.size))
            tensors = []
            for shape, dtype in self._tensor_specs(n):
                t = torch.empty(shape, dtype=dtype)
                if t.nbytes:
                    self._read_exact(sock, t.nbytes, writable_bytes(t))
                tensors.append(t)
            parts.append(tensors)
            counts.append(n)
        cat = [torch.cat([p[i] for p in parts]) for i in range(len(parts[0]))]
        extras = {e.name: t for e, t in zip(self.context.ffn_extras, cat[1:], strict=True)}
        return A2FPayload(cat[0], TransferMetadata(layer, stage_idx, tuple(counts)), extras)

    def send_ffn_output(self, output: torch.Tensor, metadata: TransferMetadata) -> None:
        self.require_role("ffn", "send_ffn_output")
        self.check_stage(metadata.stage_idx)
        if self._writer_error is not None:
            raise self._writer_error
        self.check_ffn_send(output, metadata, len(self._socks[metadata.stage_idx]))
        output = output.contiguous()
        start = 0
        for sock, n in zip(self._socks[metadata.stage_idx], metadata.seq_lens, strict=True):
            chunk = output[start : start + n]
            start += n
            frames = [_HEADER.pack(metadata.layer_idx, metadata.stage_idx, n), tensor_bytes(chunk)]
            if self.extra.blocking_ffn_send:
                self._write(sock, frames)  # broken on purpose: waits for the attention side to read
            else:
                self._senders[metadata.stage_idx][0].put((sock, frames, chunk))


class NoControlPlaneTcpConnector(TcpAFDConnector):
    """Broken on purpose, written against the old contract: it reports no control plane."""

    name = "NoControlPlaneTcpConnector"

    @property
    def control_plane(self) -> Any:
        return None


class MemoisingTcpConnector(TcpAFDConnector):
    """Broken on purpose: it memoises its send checks by stage, so a stage that passed them once is never checked.

    A check may be memoised only by everything it depends on (here: the metadata, the shape and dtype of the
    tensors, and whether a send is pending); the conformance suite repeats its misuse after a whole step.
    """

    name = "MemoisingTcpConnector"

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self._checked: set[int] = set()

    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        stage = metadata.stage_idx
        if stage not in self._checked:
            super().send_attn_output(hidden_states, metadata, extras=extras)
            self._checked.add(stage)
            return
        self._write_a2f(metadata, metadata.seq_lens[0], [hidden_states, *(extras or {}).values()])


class StorageStartTcpConnector(TcpAFDConnector):
    """Broken on purpose: it sends each tensor from the start of its storage, not from the tensor's first element.

    Every tensor the other tests send starts its storage, so it passes them; the suite's static-buffer test
    sends views at an offset into a buffer.
    """

    name = "StorageStartTcpConnector"

    def _write_a2f(self, metadata: TransferMetadata, n: int, tensors: list[torch.Tensor]) -> None:
        at_start = [torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, t.shape) for t in tensors]
        super()._write_a2f(metadata, n, at_start)


class ThreadLeakingTcpConnector(TcpAFDConnector):
    """Broken on purpose: every ``open()`` starts a helper thread that ``close()`` never stops.

    One init/close cycle cannot tell a leak from a thread that belongs there; the suite's lifecycle test runs two
    and compares what each left behind.
    """

    name = "ThreadLeakingTcpConnector"

    def open(self) -> None:
        super().open()
        never = threading.Event()  # never set: the thread outlives close()
        threading.Thread(target=never.wait, name="leaked-helper", daemon=True).start()


class FdLeakingTcpConnector(TcpAFDConnector):
    """Broken on purpose: every ``open()`` opens a socket that ``close()`` never closes."""

    name = "FdLeakingTcpConnector"

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        self._leaked: list[socket.socket] = []  # referenced, so garbage collection cannot close them either

    def open(self) -> None:
        super().open()
        self._leaked.append(socket.socket())
