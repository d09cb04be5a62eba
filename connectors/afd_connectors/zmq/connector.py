"""``ZmqAFDConnector`` (alias ``zmq``): hidden states over ZMQ tcp or ipc.

Per FFN rank ``f`` and stage ``s`` a ROUTER binds the data endpoint
``port + F + f*S + s`` (tcp) or ``ipc://<ipc_dir>/afd-<port>-data<f>-<s>``;
each Attention rank connects one DEALER per stage. One socket per stage keeps
micro-batch threads from sharing a socket. A message is multipart
``[header, hidden, *extras]``: a msgpack :class:`~afd_sdk.wire.TensorHeader`
then raw buffers, sent from the tensor's storage (zero-copy from 64 KiB) and
received as tensors over the received frames. Each message moves in one call
of the C wire (:mod:`afd_connectors.zmq.wire`; ``connector_extra_config.wire``), and
with it, where :mod:`afd_connectors.zmq._zmqsteady` is built, each call's steady state
is one C++ call that declines to the Python below whatever it cannot serve.
Control, handshake and liveness come from :class:`~afd_sdk.control.ZmqControlPlane`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, TypeVar

import msgspec
import torch
import zmq

from afd_connectors import native
from afd_connectors.zmq.wire import make_steady, native_wire_problem, select_wire
from afd_sdk.connector import AFDConnector, ConnectorCapabilities, ConnectorContext
from afd_sdk.control import (
    BufferPool,
    HeaderCache,
    PlanCache,
    ZmqControlPlane,
    ZmqEndpoint,
    endpoint_address,
    frame_size_error,
    frame_tensor,
    nbytes_of,
    spec_of,
    tensor_header,
    terminate_context,
)
from afd_sdk.errors import AFDConfigError, ConnectorError, PeerLostError, WireFormatError
from afd_sdk.topology import FFNFirstWorld
from afd_sdk.wire import (
    COMMON_DTYPES,
    A2FPayload,
    TensorHeader,
    TensorSpec,
    TransferMetadata,
    decode_header,
    dtype_from_name,
    dtype_to_name,
    encode_header,
)

__all__ = ["ZmqAFDConnector", "ZmqExtraConfig"]

#: received frames smaller than this are copied into fixed receive areas (one memcpy, no tensor created);
#: larger ones are adopted zero-copy. Measured against 64 KiB and 1 MiB: at 64-128 KiB a copy beats creating
#: a tensor over the frame; at 512 KiB the copy costs more than it saves.
RECV_COPY_MAX = 256 * 1024

_now = time.monotonic
_V = TypeVar("_V")

#: attention side, per (layer, stage, tokens, dtype): the expected f2a header, its spec, the view the wire
#: copies a small frame behind (or None), that frame's byte count, and the wire's ``into`` argument
_F2AIn = tuple[bytes, TensorSpec, "torch.Tensor | None", int, "tuple[Any, ...] | None"]
#: the awaited a2f message in a receive's errors: %-formatted with (stage, peers pending) only on failure
_A2F_WHAT = "hidden states of stage %d (%d peer(s) pending)"
#: what decides every check of a send: the call's metadata, and the tensor's shape and dtype
_PlanKey = tuple[TransferMetadata, torch.Size, torch.dtype]
#: ffn side with one peer, per (stage, header bytes) accepted: frame count, header, metadata, the receive areas'
#: views, and the payload of those views when every tensor lands in its area
_A2FKnown = tuple[int, TensorHeader, TransferMetadata, list["tuple[torch.Tensor, int] | None"], "A2FPayload | None"]


class ZmqExtraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``connector_extra_config`` of ``ZmqAFDConnector``.

    * ``transport``: ``"tcp"`` (default; binds only to ``afd.host``) or ``"ipc"``
      (same host, Unix sockets under ``ipc_dir``).
    * ``ipc_dir``: directory for ipc endpoints (default ``$TMPDIR`` or ``/tmp``).
    * ``wire``: how a message moves: ``"native"`` (one C call per message,
      :mod:`afd_connectors.zmq._zmqwire`), ``"pyzmq"``, or ``"auto"`` (default:
      native where its module is built, else pyzmq). Both sides may differ:
      the bytes on the wire are the same.
    """

    transport: Literal["tcp", "ipc"] = "tcp"
    ipc_dir: str | None = None
    wire: Literal["auto", "native", "pyzmq"] = "auto"


class ZmqAFDConnector(AFDConnector):
    """ZMQ transport for the FFN-first world (any A ≥ F), CPU tensors."""

    name = "ZmqAFDConnector"
    capabilities: ClassVar[ConnectorCapabilities] = ConnectorCapabilities(
        devices=frozenset({"cpu"}),
        world_layout="ffn_first",
        attention_lt_ffn=False,
        supports_extras=True,
        dtypes=COMMON_DTYPES,
    )
    extra_config_schema = ZmqExtraConfig
    #: ``afd bench connector --raw wire``: this connector's own wire and tensors, without its contract
    raw_baselines: ClassVar[Mapping[str, str | None]] = {"zmq": None, "wire": "afd_connectors.zmq.raw:RawZmqWire"}

    @classmethod
    def native_modules(cls) -> Mapping[str, str | None]:
        return native.problems("zmq._zmqwire", "zmq._zmqsteady")

    @classmethod
    def validate_config(cls, config: object) -> None:  # type: ignore[override]
        super().validate_config(config)  # type: ignore[arg-type]
        wire = config.connector_extra_config.get("wire", "auto")  # type: ignore[attr-defined]
        problem = native_wire_problem() if wire == "native" else None
        if problem is not None:
            raise AFDConfigError(
                f"afd.connector_extra_config.wire='native' cannot run here ({problem}); expected an installed "
                "afd-sdk (pip install builds afd_connectors.zmq._zmqwire with a C compiler), or wire 'auto' or 'pyzmq'",
                key="afd.connector_extra_config.wire",
                value=wire,
            )

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        wire = select_wire(self.extra.wire)
        #: ``"native"`` or ``"pyzmq"``: how each message moves (:mod:`afd_connectors.zmq.wire`)
        self.wire_name = wire.name
        self._part, self._send, self._recv = wire.part, wire.send, wire.recv
        self._handle_of = wire.handle
        self._handles: list[Any] = []  # each stage socket's handle for the wire
        #: the steady state in C++ (native wire, where afd_connectors.zmq._zmqsteady is built; see open()): each call
        #: first tries it, and it declines (changing nothing) whatever the Python below must handle
        self._steady: Any = None
        #: fixed receive areas the wire copies small frames into, by (direction, stage, ...); never reallocated
        self._areas: dict[tuple[Any, ...], torch.Tensor] = {}
        self._f2a_in: PlanCache[tuple[int, int, int, torch.dtype], _F2AIn] = PlanCache()
        self._a2f_areas: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._a2f_views: PlanCache[tuple[int, int, bytes], list[tuple[torch.Tensor, int] | None]] = PlanCache()
        #: the steady state's memoised checks (each map is cleared at ``HeaderCache.limit`` entries):
        #: attention side, (metadata, shape, dtype) of a valid send -> (socket handle, send record, header)
        self._send_plans: PlanCache[_PlanKey, tuple[Any, tuple[int, int], bytes]] = PlanCache()
        #: ffn side with one peer: the stages served so far -> the wire's ``into`` for their messages
        self._a2f_fast: dict[int, tuple[Any, ...]] = {}
        #: ffn side with one peer, (stage, header bytes) of an accepted message -> see :meth:`_accept_one`
        self._a2f_known: PlanCache[tuple[int, bytes], _A2FKnown] = PlanCache()
        #: ffn side with one peer, (metadata, shape, dtype) of a valid output -> (socket handle, peer, header)
        self._f2a_plans: PlanCache[_PlanKey, tuple[Any, bytes, bytes]] = PlanCache()
        self._zctx: zmq.Context | None = None
        self._data: list[ZmqEndpoint] = []
        self._pool = BufferPool()
        self._headers = HeaderCache()
        #: (layer, stage, tokens, dtype) -> the f2a header's bytes and its tensor spec (both sides build it)
        self._f2a: PlanCache[tuple[int, int, int, torch.dtype], tuple[bytes, TensorSpec]] = PlanCache()
        self._peer_ids: dict[bytes, int] = {}
        self._peer_order: list[bytes] = []
        self._hidden = context.model.hidden_size
        self._extras = context.ffn_extras
        self._tensor_names = ("hidden_states", *(e.name for e in self._extras))

    # --- lifecycle ----------------------------------------------------------

    def data_address(self, ffn_rank: int, stage: int) -> str:
        cfg = self.config
        port = cfg.port + cfg.num_ffn_ranks + ffn_rank * cfg.num_stages + stage
        return endpoint_address(
            self.extra.transport, cfg.ffn_host(ffn_rank), port, self.extra.ipc_dir, f"data{ffn_rank}-{stage}"
        )

    def open(self) -> None:
        cfg = self.config
        self._zctx = zmq.Context(io_threads=1)
        control = ZmqControlPlane(
            self.context,
            connector_name=self.name,
            transport=self.extra.transport,
            ipc_dir=self.extra.ipc_dir,
            zmq_context=self._zctx,
        )
        world = self.world
        assert isinstance(world, FFNFirstWorld)
        if self.role == "ffn":
            # bind data endpoints first so attention peers can connect right after the handshake
            for s in range(cfg.num_stages):
                self._data.append(
                    ZmqEndpoint(
                        self._zctx,
                        "bind",
                        self.data_address(self.role_rank, s),
                        timeout_s=cfg.timeout_s,
                        peer_name="attention peer",
                    )
                )
            peers = world.attention_for_ffn(self.role_rank)
            self._peer_order = [b"a%d" % r for r in peers]
            self._peer_ids = {ident: i for i, ident in enumerate(self._peer_order)}
            self.attach_control_plane(control)
        else:
            self.attach_control_plane(control)
            ffn = world.ffn_for_attention(self.role_rank)
            for s in range(cfg.num_stages):
                self._data.append(
                    ZmqEndpoint(
                        self._zctx,
                        "connect",
                        self.data_address(ffn, s),
                        timeout_s=cfg.timeout_s,
                        identity=b"a%d" % self.role_rank,
                        peer_name=f"ffn rank {ffn}",
                    )
                )
        self._handles = [self._handle_of(ep.sock) for ep in self._data]
        # not for an ffn rank with several attention peers: its fan-in runs in Python, and each send would first
        # make a C++ call that can only decline
        if self.wire_name == "native" and len(self._peer_order) <= 1:
            ident = self._peer_order[0] if self._peer_order else b""
            self._steady = make_steady(self._handles, self._hidden, self.sends, ident, self._headers.limit)

    def release(self) -> None:
        data, self._data = self._data, []
        self._handles = []
        steady, self._steady = self._steady, None
        if steady is not None:
            steady.clear()
        try:
            for ep in data:
                ep.close()
        finally:
            if self._zctx is not None:
                terminate_context(self._zctx, f"{self.display_name} ({self.role} rank {self.role_rank})")
                self._zctx = None
            self._pool.clear()
            self._headers.clear()
            self._f2a.clear()
            self._f2a_in.clear()
            self._a2f_views.clear()
            self._send_plans.clear()
            self._a2f_fast.clear()
            self._a2f_known.clear()
            self._f2a_plans.clear()
            self._a2f_areas.clear()
            self._areas.clear()

    # --- attention side -----------------------------------------------------

    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        # the steady state in C++: the checks below, for a (layer, stage, tokens, dtype) that passed them once
        steady = self._steady
        if steady is not None and extras is None and steady.attn_send(hidden_states, metadata):
            return
        # the steady state in Python: every check below depends only on (metadata, shape, dtype) and on state
        # fixed for the session, so a key that passed them once passes again (a plan exists only for an
        # initialised attention side whose model declares no extras); what is checked per call is no send pending
        plan = self._send_plans.get((metadata, hidden_states.shape, hidden_states.dtype))
        if plan is not None and extras is None and metadata.stage_idx not in self.sends:
            handle, sent, header = plan
            stage = metadata.stage_idx
            self.sends[stage] = sent
            try:
                self._send(handle, [header, self._part(hidden_states)])
            except BaseException:
                del self.sends[stage]
                raise
            return
        self.require_role("attention", "send_attn_output")
        stage = metadata.stage_idx
        self.check_stage(stage)
        n = self.check_attn_send(hidden_states, metadata)
        self.check_no_send_pending(stage)
        tensors = [hidden_states, *self.check_extras(extras, n)] if self._extras else [hidden_states]
        # extras passed check_extras, so their specs follow from n: the key decides the whole header
        header = self._headers.encoded(
            (metadata.layer_idx, stage, n, hidden_states.dtype),
            lambda: tensor_header("a2f", metadata, metadata.seq_lens, self._tensor_names, tensors),
        )
        parts = [header, *map(self._part, tensors)]
        # bookkeeping first: the send wakes libzmq's I/O thread, and on few cores whatever this thread still
        # does after it competes with that thread (measured: one preemption per round trip)
        self.record_send(metadata, n)
        try:
            self._send(self._handles[stage], parts)
        except BaseException:
            self.take_send(stage)
            raise
        if not self._extras:
            if steady is not None:
                steady.remember_send(metadata.layer_idx, stage, n, hidden_states.dtype, header)
            else:
                key = (metadata, hidden_states.shape, hidden_states.dtype)
                self._send_plans.remember(key, (self._handles[stage], self.sends[stage], header))

    def _f2a_header(self, layer: int, stage: int, n: int, dtype: torch.dtype) -> tuple[bytes, TensorSpec]:
        """The f2a header for ``n`` tokens of ``dtype``: what the FFN sends and the attention side expects."""
        key = (layer, stage, n, dtype)
        cached = self._f2a.get(key)
        if cached is None:
            spec = TensorSpec("ffn_output", dtype_to_name(dtype), (n, self._hidden))
            header = encode_header(TensorHeader("f2a", layer, stage, (n,), (spec,)))
            cached = self._f2a.remember(key, (header, spec))
        return cached

    def _recv_message(
        self, stage: int, nbytes_parts: int, start: float, into: tuple[Any, ...] | None, what: str, *what_args: object
    ) -> list[Any]:
        """The next whole message on ``stage``'s socket, waiting at most ``timeout_s`` from ``start``.

        Liveness and the deadline are checked every receive slice. ``what`` is a %-format of ``what_args``, the
        awaited message for the errors, formatted only then: the hot path builds no string and no closure.
        """
        handle, recv = self._handles[stage], self._recv
        parts = recv(handle, nbytes_parts, into)
        if parts is not None:
            return parts
        ep = self._data[stage]
        deadline = start + ep.timeout_s
        while True:
            ep.check(deadline, what % what_args)
            parts = recv(handle, nbytes_parts, into)
            if parts is not None:
                return parts

    def _area(self, key: tuple[Any, ...]) -> torch.Tensor:
        """The fixed receive area ``key`` (``RECV_COPY_MAX`` bytes), allocated once: the wire's addresses never move."""
        area = self._areas.get(key)
        if area is None:
            area = self._areas[key] = torch.empty(RECV_COPY_MAX, dtype=torch.uint8)
        return area

    def _small(self, key: tuple[Any, ...], spec: TensorSpec) -> tuple[torch.Tensor, int] | None:
        """A tensor of ``spec`` over receive area ``key`` and its byte count, for a frame the wire copies there.

        ``None`` from ``RECV_COPY_MAX`` bytes up: such frames arrive zero-copy. A returned view is overwritten
        by the next receive into ``key``.
        """
        nbytes = nbytes_of(spec)
        if nbytes >= RECV_COPY_MAX:
            return None
        return self._area(key)[:nbytes].view(dtype_from_name(spec.dtype)).view(spec.shape), nbytes

    def _f2a_expected(self, layer: int, stage: int, n: int, dtype: torch.dtype) -> _F2AIn:
        """Attention side: what the f2a message for ``n`` tokens of ``dtype`` must be, and where it lands."""
        key = (layer, stage, n, dtype)
        cached = self._f2a_in.get(key)
        if cached is None:
            header, spec = self._f2a_header(layer, stage, n, dtype)
            small = self._small(("f2a", stage), spec)
            out, nbytes = small if small is not None else (None, -1)
            into = ((self._area(("f2a", stage)).data_ptr(), nbytes),) if small is not None else None
            cached = self._f2a_in.remember(key, (header, spec, out, nbytes, into))
        return cached

    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        steady = self._steady
        if steady is not None:  # the C++ steady state: the output, a message to check here, or None (nothing done)
            got = steady.attn_recv(ref_tensor, stage_idx)
            if got is not None:
                if got.__class__ is not tuple:
                    return got
                layer, n, parts = got
                expect = self._f2a_expected(layer, stage_idx, n, ref_tensor.dtype)
                return self._f2a_output(parts, expect, layer, stage_idx)
        start = _now()
        # a send is recorded only on an initialised attention side, for a stage it validated
        sent = self.sends.pop(stage_idx, None)
        if sent is None:  # the checks in order: role, stage, then the missing send
            self.require_role("attention", "recv_ffn_output")
            self.check_stage(stage_idx)
            sent = self.take_send(stage_idx)
        layer, n = sent
        dtype = ref_tensor.dtype
        expect = self._f2a_in.get((layer, stage_idx, n, dtype)) or self._f2a_expected(layer, stage_idx, n, dtype)
        expected, spec, out, nbytes, into = expect
        if steady is not None:  # it declined: it may have forgotten this key (its maps are cleared at a limit)
            steady.remember_recv(
                layer, stage_idx, n, dtype, expected, out, nbytes if out is not None else nbytes_of(spec)
            )
        parts = self._recv_message(stage_idx, 1, start, into, "the ffn output of layer %d, stage %d", layer, stage_idx)
        return self._f2a_output(parts, expect, layer, stage_idx)

    def _f2a_output(self, parts: list[Any], expect: _F2AIn, layer: int, stage: int) -> torch.Tensor:
        """The FFN output in the received f2a message ``parts`` (header bytes, then the tensor frame: its size
        when the wire copied it into the area behind ``out``, else a buffer), once valid; else the error."""
        expected, spec, out, nbytes, _into = expect
        if len(parts) != 2 or parts[0] != expected:
            self._check_f2a(parts, spec, layer, stage)
        got = parts[1]
        if got.__class__ is int:  # copied into the fixed area behind ``out``
            if got != nbytes:
                raise frame_size_error(spec, got)
            return out
        return frame_tensor(got, spec)

    def _check_f2a(self, parts: list[Any], want: TensorSpec, layer: int, stage: int) -> None:
        """The slow path for an f2a message not byte-equal to the expected one: accept it if equal, else raise."""
        header = decode_header(parts[0])
        if len(parts) != 2 or len(header.tensors) != 1:
            raise WireFormatError(
                f"f2a message for layer {layer} carries {len(header.tensors)} tensor header(s) and "
                f"{len(parts) - 1} tensor frame(s); expected 1 and 1"
            )
        spec = header.tensors[0]
        got = (spec.shape, spec.dtype, header.layer_idx, header.stage_idx)
        expected = (want.shape, want.dtype, layer, stage)
        if got != expected:
            raise ConnectorError(f"ffn output (shape, dtype, layer, stage)={got}; expected {expected}")

    # --- ffn side -------------------------------------------------------------

    def recv_attn_output(self, stage_idx: int = 0) -> A2FPayload:
        start = _now()
        # one attention peer, on a stage served before: a header byte-equal to one accepted on this stage passes
        # the same checks again, so the steady state looks up the header and the sender and converts the frames
        into = self._a2f_fast.get(stage_idx)
        if into is not None:
            steady = self._steady  # in C++: the payload, a message to check here, or None (nothing done)
            msg = steady.ffn_recv(stage_idx) if steady is not None else None
            if msg is None:
                msg = self._recv_message(stage_idx, 2, start, into, _A2F_WHAT, stage_idx, 1)
            elif msg.__class__ is not list:
                return msg
            known = self._a2f_known.get((stage_idx, msg[1])) if len(msg) >= 2 else None
            if known is None or msg[0] != self._peer_order[0] or len(msg) != known[0]:
                known = self._accept_one(stage_idx, msg)
            return self._one_peer_payload(msg, known)
        self.require_role("ffn", "recv_attn_output")
        self.check_stage(stage_idx)
        npeers = len(self._peer_order)
        if npeers == 1:  # the common 1:1 case: no fan-in bookkeeping
            into = self._a2f_into(stage_idx, 0)
            msg = self._recv_message(stage_idx, 2, start, into, _A2F_WHAT, stage_idx, 1)
            payload = self._one_peer_payload(msg, self._accept_one(stage_idx, msg))
            self._a2f_fast[stage_idx] = into
            if self._steady is not None:
                self._steady.ffn_ready(stage_idx, list(into))
            return payload
        parts: list[list[torch.Tensor] | None] = [None] * npeers
        counts = [0] * npeers
        layer = None
        for _ in range(npeers):
            idx, header, got = self._recv_one(stage_idx, start, layer, parts)
            layer = header.layer_idx
            counts[idx] = header.seq_lens[0]
            parts[idx] = got
        ready = [p for p in parts if p is not None]
        tensors = [self._concat(stage_idx, t, [p[t] for p in ready]) for t in range(len(ready[0]))]
        return self._payload(tensors, TransferMetadata(layer, stage_idx, tuple(counts)))

    def _payload(self, tensors: list[torch.Tensor], metadata: TransferMetadata) -> A2FPayload:
        """The payload of ``tensors`` (hidden states, then the declared extras in order)."""
        extras = {spec.name: t for spec, t in zip(self._extras, tensors[1:], strict=True)} if self._extras else {}
        return A2FPayload(tensors[0], metadata, extras)

    def _accept_one(self, stage: int, msg: list[Any]) -> _A2FKnown:
        """One peer: validate ``msg``'s sender and header on ``stage`` (raising), and remember them by header bytes.

        The entry: frame count, header, metadata, the receive areas' views, and the payload of those views
        (``None`` unless every tensor is small enough to land in its area).
        """
        header = self._accept_a2f(stage, msg, None, [None])
        views = self._a2f_area_views(stage, 0, msg[1], header)
        metadata = TransferMetadata(header.layer_idx, stage, header.seq_lens)
        landed: A2FPayload | None = None
        if all(v is not None for v in views):
            landed = self._payload([v[0] for v in views if v is not None], metadata)
        if self._steady is not None:
            specs = header.tensors
            self._steady.remember_a2f(
                stage,
                msg[1],
                [nbytes_of(t) for t in specs],
                [v[0] if v is not None else None for v in views],
                [t.shape for t in specs],
                [dtype_from_name(t.dtype) for t in specs],
                metadata,
                tuple(e.name for e in self._extras),
                landed,
            )
        return self._a2f_known.remember((stage, msg[1]), (len(msg), header, metadata, views, landed))

    def _one_peer_payload(self, msg: list[Any], known: _A2FKnown) -> A2FPayload:
        """The payload of an accepted one-peer message: the cached one when every frame landed in its area."""
        _nframes, header, metadata, views, landed = known
        tensors, all_landed = self._frame_tensors(msg, header, views)
        if all_landed:
            return landed  # type: ignore[return-value]  # every view exists when every frame landed
        return self._payload(tensors, metadata)

    def _recv_one(
        self, stage: int, start: float, layer: int | None, parts: list[list[torch.Tensor] | None]
    ) -> tuple[int, TensorHeader, list[torch.Tensor]]:
        """Fan-in: receive one attention peer's message for ``stage`` (the call began at ``start``); validate it
        against the others.

        Returns the sender's index, the header and the tensors.
        """
        pending = parts.count(None)
        slot = len(parts) - pending  # the how-manieth message of this call: its own receive areas
        msg = self._recv_message(stage, 2, start, self._a2f_into(stage, slot), _A2F_WHAT, stage, pending)
        header = self._accept_a2f(stage, msg, layer, parts)
        tensors, _landed = self._frame_tensors(msg, header, self._a2f_area_views(stage, slot, msg[1], header))
        return self._peer_ids[msg[0]], header, tensors

    def _accept_a2f(
        self, stage: int, msg: list[Any], layer: int | None, parts: list[list[torch.Tensor] | None]
    ) -> TensorHeader:
        """``msg``'s header once its sender, header and frame count are valid here; else ``WireFormatError``."""
        ident = msg[0]
        try:
            if len(msg) < 2:
                raise WireFormatError("a message without a header")
            header = self._headers.decoded(msg[1], self._a2f_problem)
            problem = self._check_a2f(header, self._peer_ids.get(ident), parts, stage, layer)
            if problem is None and len(msg) != 2 + len(header.tensors):
                problem = f"{len(msg) - 2} tensor frame(s); the header announced {len(header.tensors)}"
            if problem:
                raise WireFormatError(problem)
        except WireFormatError as exc:
            raise WireFormatError(f"a2f message from {ident.decode(errors='replace')}: {exc}") from None
        return header

    def _a2f_into(self, stage: int, slot: int) -> tuple[Any, ...]:
        """Where the wire may copy the tensor frames of ``stage``'s ``slot``-th message (one area per tensor)."""
        key = (stage, slot)
        into = self._a2f_areas.get(key)
        if into is None:
            into = tuple(
                (self._area(("a2f", stage, slot, t)).data_ptr(), RECV_COPY_MAX - 1)
                for t in range(len(self._tensor_names))
            )
            self._a2f_areas[key] = into
        return into

    def _a2f_area_views(
        self, stage: int, slot: int, header_bytes: bytes, header: TensorHeader
    ) -> list[tuple[torch.Tensor, int] | None]:
        """Per tensor of ``header``: the view of its receive area and byte count, or ``None`` (arrives zero-copy)."""
        key = (stage, slot, header_bytes)
        views = self._a2f_views.get(key)
        if views is None:
            views = [self._small(("a2f", stage, slot, t), spec) for t, spec in enumerate(header.tensors)]
            self._a2f_views.remember(key, views)
        return views

    @staticmethod
    def _frame_tensors(
        msg: list[Any], header: TensorHeader, views: list[tuple[torch.Tensor, int] | None]
    ) -> tuple[list[torch.Tensor], bool]:
        """The message's tensors: views of the receive areas the wire copied into, or over zero-copy frames;
        and whether all of them are the areas' views."""
        out = []
        landed = True
        for got, spec, small in zip(msg[2:], header.tensors, views, strict=True):
            if got.__class__ is not int:
                out.append(frame_tensor(got, spec))
                landed = False
            elif small is not None and got == small[1]:
                out.append(small[0])
            else:
                raise frame_size_error(spec, got)
        return out, landed

    def _check_a2f(
        self,
        header: TensorHeader,
        idx: int | None,
        parts: list[list[torch.Tensor] | None],
        stage: int,
        layer: int | None,
    ) -> str | None:
        """What this message must satisfy now (sender, stage, layer); the header itself passed :meth:`_a2f_problem`."""
        if idx is None:
            return "unknown sender; not an attention peer of this ffn rank"
        if parts[idx] is not None:
            return f"second message for stage {stage} before the ffn output was sent"
        if header.stage_idx != stage:
            return f"stage {header.stage_idx} arrived on the socket of stage {stage}"
        if layer is not None and header.layer_idx != layer:
            return f"layer {header.layer_idx} while other peers sent layer {layer}"
        return None

    def _a2f_problem(self, header: TensorHeader) -> str | None:
        """What is wrong with an a2f header whatever its sender (remembered by bytes once valid)."""
        if header.kind != "a2f" or len(header.seq_lens) != 1:
            got = f"kind={header.kind!r} stage={header.stage_idx} seq_lens={header.seq_lens}"
            return f"{got}; expected an a2f with one seq_len"
        tensors = header.tensors
        names = self._tensor_names
        if len(tensors) != len(names) or any(t.name != n for t, n in zip(tensors, names, strict=True)):
            return f"tensors {[t.name for t in tensors]}; expected {list(self._tensor_names)}"
        shape = tensors[0].shape
        if len(shape) != 2 or shape[1] != self._hidden or shape[0] != header.seq_lens[0]:
            return f"hidden_states shape {list(shape)}; expected [{header.seq_lens[0]}, {self._hidden}]"
        return None

    def _concat(self, stage: int, t_idx: int, chunks: list[torch.Tensor]) -> torch.Tensor:
        if len({c.dtype for c in chunks}) != 1:
            raise WireFormatError(
                f"attention peers sent tensor #{t_idx} in different dtypes {[c.dtype for c in chunks]}"
            )
        total = sum(c.shape[0] for c in chunks)
        spec = spec_of("cat", chunks[0])
        spec = msgspec.structs.replace(spec, shape=(total, *spec.shape[1:]))
        out, _ = self._pool.tensor(("cat", stage, t_idx), spec)
        return torch.cat(chunks, out=out)

    def send_ffn_output(self, output: torch.Tensor, metadata: TransferMetadata) -> None:
        # one peer, the steady state: the checks below depend only on (metadata, shape, dtype) and on state
        # fixed for the session (a plan exists only on an initialised ffn side with one peer)
        steady = self._steady
        if steady is not None:  # in C++: the checks below for a (layer, stage, tokens, dtype) that passed them once
            try:
                if steady.ffn_send(output, metadata):
                    return
            except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the peer's connection is gone
                raise PeerLostError(f"attention peer {self._peer_order[0].decode()} is unreachable: {exc}") from exc
        plan = self._f2a_plans.get((metadata, output.shape, output.dtype))
        if plan is not None:
            handle, ident, header = plan
            try:
                self._send(handle, [ident, header, self._part(output)])
            except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the peer's connection is gone
                raise PeerLostError(f"attention peer {ident.decode()} is unreachable: {exc}") from exc
            return
        self.require_role("ffn", "send_ffn_output")
        self.check_stage(metadata.stage_idx)
        handle, send, part = self._handles[metadata.stage_idx], self._send, self._part
        self.check_ffn_send(output, metadata, len(self._peer_order))
        single = len(self._peer_order) == 1
        layer, stage, dtype = metadata.layer_idx, metadata.stage_idx, output.dtype
        start = 0
        for ident, n in zip(self._peer_order, metadata.seq_lens, strict=True):
            chunk = output if single else output[start : start + n]
            start += n
            header, _spec = self._f2a_header(layer, stage, n, dtype)
            try:
                send(handle, [ident, header, part(chunk)])
            except zmq.ZMQError as exc:  # ROUTER_MANDATORY: the peer's connection is gone
                raise PeerLostError(f"attention peer {ident.decode()} is unreachable: {exc}") from exc
            if single and steady is not None:
                steady.remember_f2a(layer, stage, n, dtype, header)
            elif single:
                self._f2a_plans.remember((metadata, output.shape, dtype), (handle, ident, header))
