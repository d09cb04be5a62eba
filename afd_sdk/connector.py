"""The connector contract: how hidden states move between the two roles.

Two contracts share one lifecycle base, :class:`ConnectorBase`:

* :class:`AFDConnector` (this module) — the per-layer exchange: whole hidden
  states go from every Attention rank to its FFN rank and back, driven by a
  control plane that announces each step.
* :class:`~afd_sdk.dispatch.AsyncDispatchConnector` (:mod:`afd_sdk.dispatch`)
  — routed-expert dispatch/combine (CAM style), driven by work items.

A connector instance lives in one worker process and serves one role. Its life:

1. The plugin manager resolves the class from ``AFDConfig.connector`` at
   start-up; :meth:`ConnectorBase.parse_extra_config` validates
   ``connector_extra_config`` and :meth:`ConnectorBase.validate_config` vetoes
   what cannot work — still no resources.
2. The runtime constructs it with a :class:`ConnectorContext` (which carries
   the world, computed once by :func:`afd_sdk.topology.build_world`). The
   constructor only stores and checks; it opens nothing.
3. :meth:`ConnectorBase.init` (owned by the base) calls the connector's
   :meth:`~ConnectorBase.open`, which opens sockets / process groups and
   attaches the control plane (rendezvous + handshake). From then on the
   data-path methods may be called.
4. Per layer and stage the Attention side calls ``send_attn_output`` then
   ``recv_ffn_output``; the FFN side ``recv_attn_output`` then
   ``send_ffn_output``. Calls for one stage are strictly ordered by layer.
5. :meth:`ConnectorBase.close` (owned by the base) closes the control plane
   (goodbye) and calls the connector's :meth:`~ConnectorBase.release`; it is
   idempotent and safe after a partial or failed ``init``.

Data-path methods are the hot path: implementations do no plugin lookup, no
logging formatting and no pickling there.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import msgspec

from afd_sdk._compat import moved_names
from afd_sdk.adapter import ExtraSpec, MoELayout
from afd_sdk.capabilities import ConnectorCapabilities
from afd_sdk.config import AFDConfig, parse_extra_config
from afd_sdk.errors import ConnectorError
from afd_sdk.topology import World, build_world
from afd_sdk.wire import A2FPayload, ControlPayload, ModelFingerprint, TransferMetadata, dtype_to_name

if TYPE_CHECKING:
    import torch

__all__ = [
    "AFDConnector",
    "ConnectorBase",
    "ConnectorCapabilities",
    "ConnectorContext",
    "ControlPlane",
    "LostPeer",
    "NoExtraConfig",
    "SendRecord",
]

# moved to afd_sdk.dispatch in 0.1.0 (dispatch.py imports this module, so the alias resolves lazily)
__getattr__ = moved_names(
    __name__,
    {
        "AsyncDispatchConnector": "afd_sdk.dispatch:AsyncDispatchConnector",
        "FFNWorkItem": "afd_sdk.dispatch:FFNWorkItem",
    },
)


class NoExtraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Schema of a connector that accepts no ``connector_extra_config`` keys."""


@dataclass(frozen=True)
class ConnectorContext:
    """Everything a connector is constructed with; built by the runtime (``afd_sdk.runtime.build_connector``).

    ``role_rank`` is this worker's rank inside its role
    (:func:`afd_sdk.topology.role_rank`). ``max_num_tokens`` bounds the tokens
    one Attention rank sends per stage, so receive buffers can be sized once.
    ``moe`` is the model's routed-expert layout (``None`` for dense models);
    async-dispatch connectors require it. ``world`` is the rank layout from
    :func:`afd_sdk.topology.build_world`; when ``None`` (a context built by
    hand) the connector computes it from its capabilities at construction and
    keeps a copy of the context that carries it (``connector.context.world``).
    """

    config: AFDConfig
    role_rank: int
    model: ModelFingerprint
    extra_config: msgspec.Struct = field(default_factory=NoExtraConfig)
    ffn_extras: tuple[ExtraSpec, ...] = ()
    max_num_tokens: int = 8192
    device: str = "cpu"
    moe: MoELayout | None = None
    world: World | None = None

    @property
    def role(self) -> Literal["attention", "ffn"]:
        return self.config.role


@dataclass(frozen=True)
class LostPeer:
    """A peer this side depends on whose connection is gone, as :meth:`ControlPlane.lost_peers` reports it.

    ``peer`` names it the way errors do (``"ffn rank 0"``, ``"attention ranks [0, 1]"``), ``address`` is the
    control-plane address of the connection that dropped, ``lost_for_s`` the seconds since it dropped.
    """

    peer: str
    address: str
    lost_for_s: float


class ControlPlane(abc.ABC):
    """Tells the FFN side what is coming in the next step, and owns liveness.

    Every :class:`AFDConnector` has one: its ``open()`` constructs it and
    hands it to :meth:`ConnectorBase.attach_control_plane`, which calls
    :meth:`init`; the connector's ``close()`` calls :meth:`close`. The kit's
    :class:`afd_sdk.control.ZmqControlPlane` is the ready-made one.

    Attention ranks call :meth:`send` once per step before the first layer; the
    FFN side calls :meth:`recv` once per step and then serves
    ``num_stages × num_layers`` exchanges. A peer that dies makes every
    blocked call on the survivor raise ``PeerLostError`` within ``timeout_s``.
    """

    @abc.abstractmethod
    def init(self) -> None:
        """Rendezvous and handshake. Called once by :meth:`ConnectorBase.attach_control_plane`.

        Raises ``HandshakeError`` when the roles disagree and ``PeerLostError``
        when a peer does not arrive within ``timeout_s``.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Send an orderly goodbye and release resources. Idempotent; called by the connector's ``close()``."""

    @abc.abstractmethod
    def send(self, payload: ControlPayload) -> None:
        """Attention side: announce one step. Called by the runner before layer 0.

        May assume ``init()`` succeeded. Must not block longer than ``timeout_s``.
        """

    @abc.abstractmethod
    def recv(self, timeout_s: float | None = None) -> ControlPayload | None:
        """FFN side: block until the next step's payload, merged over peers.

        Returns ``None`` when every attention peer said goodbye (orderly end).
        Raises ``PeerLostError`` when a peer died or nothing came within
        ``timeout_s`` (default: the config's). The merged payload's
        ``stage_token_counts[s]`` has one entry per attention peer, fan-in order.
        """

    def lost_peers(self) -> tuple[LostPeer, ...]:
        """The peers whose connection is gone right now, also while no call is in progress; ``()`` when none is.

        Called from any thread (the ops endpoint's ``/readyz``, a metrics
        scrape) while the runtime uses the plane from its own; must be
        thread-safe and must not block. Peers that said goodbye are not lost.
        May be called before :meth:`init` and after :meth:`close` (then ``()``).
        The default reports nothing: a plane that cannot watch its peers while
        idle only fails the next blocked call (``PeerLostError``), and
        readiness then follows the world's state alone.
        """
        return ()

    #: set by :meth:`request_stop`; the FFN runtime ends serving at the next step boundary once it is true
    stop_requested: bool = False

    def request_stop(self) -> None:
        """FFN side: end serving at the next step boundary (a drain); the step in progress is served whole.

        Called from any thread (the ops endpoint's ``POST /drain``), any number of times, before or after
        :meth:`init`. Afterwards :meth:`recv` returns ``None`` instead of waiting for a step that no peer has
        started to announce, and the runtime then closes the connector, whose goodbye tells the attention
        peers this FFN rank is gone (with replicas they fail over to the next one). The default only sets
        :attr:`stop_requested`, which the runtime reads between steps: a plane whose ``recv`` blocks while idle
        should also wake it (the built-in plane looks at least once a second).
        """
        self.stop_requested = True

    def apply(self, payload: ControlPayload) -> None:
        """Record ``payload`` as the current step locally (both roles).

        Called by the runtime after :meth:`send` / :meth:`recv`; connectors read
        :attr:`current` to size the step's buffers.
        """
        self._current = payload

    @property
    def current(self) -> ControlPayload | None:
        """The payload last passed to :meth:`apply`, or ``None`` before the first step."""
        return getattr(self, "_current", None)


class SendRecord(dict[int, tuple[int, int]]):
    """The attention side's sends awaiting their FFN output: ``stage_idx -> (layer_idx, num_tokens)``.

    Lifetime: one per :class:`~afd_sdk.connector.AFDConnector` (``connector.sends``), created empty by its
    constructor and cleared by ``close()``. Who writes it: ``send_attn_output`` adds the stage once the send is on
    its way (:meth:`~afd_sdk.connector.AFDConnector.record_send`), ``recv_ffn_output`` removes it when it returns
    that stage's output (:meth:`~afd_sdk.connector.AFDConnector.take_send`); a native steady state holds the same
    object and does both without a Python call. What it guarantees: at most one entry per stage (a second send on a
    stage before its receive is a ``ConnectorError``), so ``recv_ffn_output`` knows which layer and how many
    tokens to expect. Readers outside the connector (tests, failover) may only read it.
    """

    __slots__ = ()


class ConnectorBase(abc.ABC):  # noqa: B024 - abstract by intent: the two contracts below add the methods
    """What every connector shares: configuration, world, lifecycle and argument checks.

    Subclass :class:`AFDConnector` (per-layer exchange) or
    :class:`~afd_sdk.dispatch.AsyncDispatchConnector` (routed dispatch), never
    this class directly. Class attributes a subclass sets: ``name``
    (canonical registry name) and ``capabilities``; one that takes
    ``connector_extra_config`` sets ``extra_config_schema`` to a closed
    ``msgspec.Struct``.

    The base owns the lifecycle: :meth:`init` and :meth:`close` are template
    methods around the connector's :meth:`open` and :meth:`release`, and hold
    the initialised flag, the double-``init`` and close-after-failed-``init``
    rules and the control plane.
    """

    name: ClassVar[str] = ""
    capabilities: ClassVar[ConnectorCapabilities] = ConnectorCapabilities()
    extra_config_schema: ClassVar[type[msgspec.Struct]] = NoExtraConfig
    #: the raw transports ``afd bench connector`` measures this connector against by default, in order: name ->
    #: lazy ``"module:Class"`` of a raw transport of the connector's own (its data path without the contract),
    #: or ``None`` for one the benchmark ships (``"zmq"``, ``"gloo"``, ``"memcpy"``). Empty: raw ZMQ and Gloo.
    #: See :mod:`afd_sdk.bench.connector_bench`; the benchmark decides by this, never by the connector's name.
    raw_baselines: ClassVar[Mapping[str, str | None]] = {}
    #: whether ``open()`` must attach a control plane (point-to-point connectors: yes)
    requires_control_plane: ClassVar[bool] = False

    def __init__(self, context: ConnectorContext) -> None:
        """Store the context and resolve the world. Opens nothing; called by the runtime after validation."""
        if context.world is None:  # a context built by hand: resolve once, so everything built from it agrees
            context = dataclasses.replace(context, world=self.world_for(context.config, context.moe))
        self.context = context
        self.config = context.config
        self.role = context.config.role
        self.role_rank = context.role_rank
        #: the rank layout, computed once (:func:`afd_sdk.topology.build_world`)
        self.world: World = context.world
        self.world.global_rank(self.role, self.role_rank)  # range check: TopologyError names the rank
        self._hidden_size = context.model.hidden_size  # read by the per-message checks
        self._num_stages = context.config.num_stages
        self._initialized = False
        self._control: ControlPlane | None = None
        extra = context.extra_config
        #: the parsed ``connector_extra_config`` (the schema's defaults when none was parsed)
        self.extra: Any = extra if isinstance(extra, self.extra_config_schema) else self.extra_config_schema()

    # --- configuration (no resources) ---------------------------------------

    @classmethod
    def parse_extra_config(cls, raw: Mapping[str, Any]) -> msgspec.Struct:
        """Validate ``connector_extra_config`` into ``extra_config_schema``.

        Called by the plugin manager / runtime before any resource exists.
        Unknown keys and wrong types raise ``AFDConfigError``.
        """
        return parse_extra_config(cls.extra_config_schema, raw, connector=cls.name or cls.__name__)

    @classmethod
    def native_modules(cls) -> Mapping[str, str | None]:
        """The optional compiled modules this connector's fast paths use: module name -> ``None`` when it loaded
        in this process, else why not (the connector then runs the same data path without it).

        Called by ``afd plugins`` after importing the class, so users see what their install built; pure, and may
        assume nothing is initialised. Default: none (a pure-Python connector).
        """
        return {}

    @classmethod
    def stage_extra_config(cls, num_stages: int) -> dict[str, Any]:
        """``connector_extra_config`` keys this connector needs to run ``num_stages`` micro-batch stages.

        Called by tools that build a config for the user (``afd demo``, the
        conformance suites) before anything is resolved; the result is merged
        into the user's extra config. Default: none.
        """
        return {}

    @classmethod
    def validate_config(cls, config: AFDConfig) -> None:
        """Reject configs this connector cannot serve (e.g. A < F). Called by the plugin manager before ``init``.

        The default checks A:F against ``capabilities`` (an FFN-first world
        needs A ≥ F); override to add rules and call ``super()``.
        """
        if cls.capabilities.world_layout == "ffn_first" and not cls.capabilities.attention_lt_ffn:
            build_world("ffn_first", config.num_attention_ranks, config.num_ffn_ranks)

    @classmethod
    def world_for(cls, config: AFDConfig, moe: MoELayout | None = None) -> World:
        """This connector's world for ``config`` (and the model's ``moe`` for an attention-first layout).

        Called by the runtime before construction and by the constructor when
        the context carries none; pure.
        """
        layout = cls.capabilities.world_layout
        experts = moe.num_experts if moe is not None and layout == "attention_first" else None
        return build_world(layout, config.num_attention_ranks, config.num_ffn_ranks, num_experts=experts)

    # --- lifecycle (owned by the base) ----------------------------------------

    def init(self) -> None:
        """Open the transport and handshake with the peer role. Called once by the runtime.

        Runs :meth:`open`. Blocks at most ``config.timeout_s``; raises
        ``HandshakeError`` on any disagreement and ``PeerLostError`` if the
        peer never arrives. After a failure the caller still calls
        :meth:`close`. A second ``init`` without ``close`` raises
        ``ConnectorError``.
        """
        if self._initialized:
            raise ConnectorError(f"{self.display_name}.init() called twice without close()")
        self.open()
        if self.requires_control_plane:
            self.require_control_plane()
        self._initialized = True

    def close(self) -> None:
        """Release everything. Idempotent; safe after a partial or failed ``init``. Called by the runtime.

        Closes the control plane first (the goodbye reaches the peers while
        the data path still exists), then runs :meth:`release`. A closed
        connector may be ``init()``-ed again.
        """
        self._initialized = False
        control, self._control = self._control, None
        try:
            if control is not None:
                control.close()
        finally:
            self.release()

    def open(self) -> None:
        """Connector hook: open sockets / process groups and attach the control plane.

        Called by :meth:`init` exactly once per ``init``; may assume the
        connector is closed. Call :meth:`attach_control_plane` where the
        transport needs the handshake (before opening process groups, so a
        mismatched peer fails before any exists). On an exception, whatever
        was opened must be reachable by :meth:`release`, which the caller's
        ``close()`` runs.
        """
        raise NotImplementedError(
            f"{self.display_name} implements neither open() nor init(); implement open() and release()"
        )

    def release(self) -> None:  # noqa: B027 - a hook with a do-nothing default, like open()'s siblings
        """Connector hook: release what :meth:`open` opened. Called by :meth:`close`, after the control plane closed.

        Must be idempotent and must work after a partial ``open()``. Default: nothing.
        """

    def attach_control_plane(self, plane: ControlPlane) -> ControlPlane:
        """Own ``plane`` and run its rendezvous + handshake (``plane.init()``). Call it from :meth:`open`.

        The plane is owned before ``init()`` runs, so a failed handshake is
        still closed by :meth:`close`. Returns ``plane``.
        """
        self._control = plane
        if self._stop_requested:  # drained before this world's plane existed: its rendezvous ends at once
            plane.request_stop()
        plane.init()
        return plane

    _stop_requested = False

    def request_stop(self) -> None:
        """FFN side: drain this world, before or after :meth:`init` (:meth:`ControlPlane.request_stop`).

        Called from any thread (the ops endpoint's ``POST /drain``). A plane attached later starts stopped,
        so a world still waiting for its attention peers ends its rendezvous with ``DrainedError``.
        """
        self._stop_requested = True
        plane = self._control
        if plane is not None:
            plane.request_stop()

    @property
    def is_initialized(self) -> bool:
        """True between a successful ``init()`` and ``close()``."""
        return self._initialized

    @property
    def control_plane(self) -> ControlPlane | None:
        """The control plane :meth:`open` attached (``None`` before ``init`` and after ``close``).

        The runtime's attention runner announces each step through it, and the
        FFN server calls ``control_plane.recv()`` once per step.
        """
        return self._control

    def lost_peers(self) -> tuple[LostPeer, ...]:
        """The peers this side depends on that are gone right now, also while the world idles; ``()`` when none.

        Called from any thread (the ops endpoint's ``/readyz``, a metrics scrape) while the runtime uses the
        connector from its own; must be thread-safe and must not block; may be called before :meth:`init` and
        after :meth:`close` (then ``()``). Default: the control plane's :meth:`ControlPlane.lost_peers`. A
        connector without a plane (routed dispatch) overrides it with its own liveness.
        """
        plane = self._control
        return () if plane is None else plane.lost_peers()

    @property
    def display_name(self) -> str:
        return self.name or type(self).__name__

    def require_control_plane(self) -> ControlPlane:
        """The control plane, or ``ConnectorError`` naming the fix when there is none.

        Called by :meth:`init` after ``open()`` for a point-to-point
        connector, by the runner's ``announce_step`` and by the FFN server.
        Reads :attr:`control_plane`, so a connector that overrides it is
        judged by what it reports.
        """
        plane = self.control_plane
        if plane is None:
            raise ConnectorError(
                f"{self.display_name} has no control plane; an AFDConnector needs one so the FFN side knows each "
                "step's work: call self.attach_control_plane(ZmqControlPlane(self.context, connector_name=self.name)) "
                "in open() (afd_sdk.control)"
            )
        return plane

    # --- argument checks every connector runs -------------------------------------

    def require_initialized(self) -> None:
        """Raise ``ConnectorError`` unless ``init()`` succeeded and ``close()`` has not run."""
        if not self.is_initialized:
            raise ConnectorError(f"{self.display_name} is not initialised; call init() first")

    def require_role(self, role: str, method: str) -> None:
        """Raise ``ConnectorError`` when ``method`` belongs to the other role."""
        if self.role != role:
            raise ConnectorError(f"{method}() is a {role}-side call; this connector serves role={self.role!r}")

    def check_stage(self, stage_idx: int) -> None:
        """Raise ``ConnectorError`` unless initialised and ``0 <= stage_idx < num_stages`` (hot path: two compares)."""
        if not self._initialized or not 0 <= stage_idx < self._num_stages:
            self.require_initialized()
            raise ConnectorError(f"stage_idx={stage_idx} is out of range; num_stages={self._num_stages}")

    def check_attn_send(self, hidden_states: torch.Tensor, metadata: TransferMetadata) -> int:
        """Validate a ``send_attn_output`` call; return the token count. Implementations call it first.

        Raises ``ConnectorError`` unless ``hidden_states`` is ``[n, hidden_size]``
        and ``metadata.seq_lens == (n,)``.
        """
        hidden = self._hidden_size
        shape = hidden_states.shape  # one torch call: this runs per layer and stage
        n = shape[0] if len(shape) == 2 else -1
        if n < 0 or shape[1] != hidden or metadata.seq_lens != (n,):
            raise ConnectorError(
                f"hidden_states {list(hidden_states.shape)} with seq_lens={metadata.seq_lens}; "
                f"expected [seq_lens[0], {hidden}] with one seq_len on the attention side"
            )
        return n

    def check_extras(self, extras: Mapping[str, torch.Tensor] | None, num_tokens: int) -> list[torch.Tensor]:
        """Validate ``extras`` against the model's declared FFN extras; return them in declaration order."""
        declared = self.context.ffn_extras
        extras = extras or {}
        names = [e.name for e in declared]
        if len(extras) != len(names) or set(extras) != set(names):
            raise ConnectorError(
                f"extras={sorted(extras)} do not match the model's declared FFN extras {names}; "
                "send exactly the declared extras"
            )
        out = []
        for spec in declared:
            t = extras[spec.name]
            want = (num_tokens, *spec.trailing_shape)
            if tuple(t.shape) != want or dtype_to_name(t.dtype) != spec.dtype:
                raise ConnectorError(
                    f"extra {spec.name!r} is {dtype_to_name(t.dtype)}{list(t.shape)}; expected {spec.dtype}{list(want)}"
                )
            out.append(t)
        return out


class AFDConnector(ConnectorBase):
    """Base class of every point-to-point AFD transport (whole hidden states per layer).

    Subclass it, implement :meth:`open`, :meth:`release` and the four
    data-path methods, and register the class through the
    ``afd_register_connectors`` hook. ``open()`` must attach a control plane
    (:meth:`attach_control_plane`; the kit's
    :class:`afd_sdk.control.ZmqControlPlane` serves any transport).
    """

    requires_control_plane: ClassVar[bool] = True

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        #: the sends awaiting their ``recv_ffn_output`` (:class:`SendRecord`: stage -> (layer,
        #: tokens)); written by :meth:`record_send` / :meth:`take_send` and by a native steady state holding it
        self.sends: SendRecord = SendRecord()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.sends.clear()

    # --- data path: Attention side ------------------------------------------

    @abc.abstractmethod
    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Attention: send one layer's post-attention-norm hidden states to FFN.

        Called by the FFN proxy once per layer and stage, after the step was
        announced on the control plane. May assume ``hidden_states`` is
        ``[metadata.seq_lens[0], hidden]`` and contiguous, ``extras`` holds
        exactly the declared FFN extras, token-aligned. The caller does not
        modify ``hidden_states`` or ``extras`` until ``recv_ffn_output`` for the
        same stage returns (a failover re-sends them). Must not wait for the FFN side to *receive*: the runner sends
        every stage of a layer before it receives any (micro-batch overlap).
        """

    @abc.abstractmethod
    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        """Attention: wait for the FFN output of the last send on ``stage_idx``.

        Returns a tensor with ``ref_tensor``'s shape, dtype and device. The
        result may live in a reused receive buffer that stays valid until the
        next ``recv_ffn_output`` for the same stage. Raises ``PeerLostError``
        after ``timeout_s``.
        """

    # --- data path: FFN side ------------------------------------------------

    @abc.abstractmethod
    def recv_attn_output(self, stage_idx: int = 0) -> A2FPayload:
        """FFN: receive one layer's hidden states from every attention peer.

        Called by the FFN server once per layer and stage, in layer order.
        Tokens are concatenated in fan-in order; ``payload.metadata.seq_lens``
        has one entry per peer. Zero tokens is legal. The payload's tensors may
        live in a reused receive buffer (or the transport's own memory) that
        stays valid until the next ``recv_attn_output`` for the same stage.
        """

    @abc.abstractmethod
    def send_ffn_output(self, output: torch.Tensor, metadata: TransferMetadata) -> None:
        """FFN: return the FFN output for the payload last received on ``metadata.stage_idx``.

        ``metadata`` is the one from that payload; the output is split by
        ``metadata.seq_lens`` back to the peers. ``output.shape[0]`` must equal
        ``metadata.num_tokens``, else ``ConnectorError``. Must not wait for
        the attention side to receive it: the server goes on to the next
        stage's ``recv_attn_output`` while the attention side may still be
        sending that stage (with large payloads a blocking send deadlocks).
        The send may still be in flight on return (the connector keeps
        ``output`` alive); the caller does not modify ``output`` afterwards.
        """

    # --- argument checks for implementations ------------------------------------

    def check_no_send_pending(self, stage_idx: int) -> None:
        """Attention side: raise unless ``stage_idx`` has no send awaiting its FFN output."""
        if stage_idx in self.sends:
            raise ConnectorError(f"stage {stage_idx} already has a send awaiting recv_ffn_output()")

    def record_send(self, metadata: TransferMetadata, num_tokens: int) -> None:
        """Attention side: remember a completed ``send_attn_output`` until its ``recv_ffn_output``."""
        self.sends[metadata.stage_idx] = (metadata.layer_idx, num_tokens)

    def take_send(self, stage_idx: int) -> tuple[int, int]:
        """Attention side: ``(layer, tokens)`` of the send ``recv_ffn_output`` answers; raises without one."""
        sent = self.sends.pop(stage_idx, None)
        if sent is None:
            raise ConnectorError(f"recv_ffn_output(stage_idx={stage_idx}) without a preceding send_attn_output")
        return sent

    def check_ffn_send(self, output: torch.Tensor, metadata: TransferMetadata, num_peers: int) -> None:
        """Validate a ``send_ffn_output`` call against this FFN rank's ``num_peers`` attention peers."""
        hidden = self._hidden_size
        if len(metadata.seq_lens) != num_peers:
            raise ConnectorError(
                f"metadata.seq_lens={metadata.seq_lens} has {len(metadata.seq_lens)} entries; "
                f"this ffn rank has {num_peers} attention peers"
            )
        shape = output.shape
        if len(shape) != 2 or shape[0] != metadata.num_tokens or shape[1] != hidden:
            raise ConnectorError(
                f"ffn output shape {list(output.shape)}; expected [{metadata.num_tokens}, {hidden}] "
                f"(sum of seq_lens={metadata.seq_lens})"
            )
