"""``CAMAsyncAFDConnector`` (alias ``cam``): routed-expert dispatch/combine between A Attention and F FFN ranks.

Attention runs the router gate (``compute_gate_on_attention``), dispatches
each token only to the FFN ranks holding its top-k experts and combines their
unweighted expert outputs with the top-k weights. Routing and token counts
travel in-band: there is no control plane, and the FFN side is driven by the
public work-item protocol of :class:`~afd_sdk.dispatch.AsyncDispatchConnector`.

The world is Attention-first (:func:`afd_sdk.topology.build_world`):
any A:F, A < F included, experts in contiguous blocks (E % F ≠ 0 allowed on
the portable backend). Two backends serve one connector:

* ``portable`` — torch.distributed point-to-point (Gloo for CPU tensors, NCCL
  for CUDA); the reference semantics, run on any machine.
* ``ascend`` — the CAM operators ``torch.ops.umdk_cam_op_lib.async_*`` on
  Ascend NPUs (torch_npu + the CAM operator package), upstream's argument order.

``backend="auto"`` (default) picks ``ascend`` for NPU tensors when the
operators import, else ``portable``.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import msgspec
import torch

from afd_connectors.cam.backend import CamBackend
from afd_connectors.cam.liveness import StoreHeartbeat
from afd_sdk.adapter import MoELayout
from afd_sdk.config import AFDConfig
from afd_sdk.connector import ConnectorCapabilities, ConnectorContext, LostPeer
from afd_sdk.dispatch import AsyncDispatchConnector, FFNWorkItem
from afd_sdk.errors import AFDConfigError, ConnectorError
from afd_sdk.metrics import FailoverStats
from afd_sdk.topology import AttentionFirstWorld, World, build_world
from afd_sdk.wire import COMMON_DTYPES, TransferMetadata, dtype_from_name

__all__ = ["CAMAsyncAFDConnector", "CamAsyncExtraConfig", "CamBackend"]

_KEY = "afd.connector_extra_config"


class CamAsyncExtraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``connector_extra_config`` of ``CAMAsyncAFDConnector`` — upstream's schema plus ``backend``.

    * ``dynamicQuant``: CAM operator dynamic quantisation mode (``0`` = off).
      Only the ``ascend`` backend quantises; ``portable`` requires ``0``.
    * ``attn_ranks_per_dp``: Attention ranks per data-parallel group (the CAM
      operators' TP width); must divide ``num_attention_ranks``. The portable
      backend dispatches every Attention rank's own tokens.
    * ``async_moe_ubatching``: two-or-more-stage MoE micro-batching; when true
      ``num_stages`` must equal ``async_moe_num_ubatches``, when false 1.
    * ``async_moe_num_ubatches``: stages of that micro-batching (>= 2).
    * ``async_moe_split``: ``"request"`` (request boundaries) or ``"token"``
      (token-balanced; not offered by the reference runtime's splitter).
    * ``backend``: ``"auto"``, ``"portable"`` or ``"ascend"``.
    * ``expert_replicas``: FFN ranks holding each routed expert (groups of
      that many ranks hold the same block; must divide ``num_ffn_ranks``).
      With more than one, the attention ranks route around a lost FFN rank and
      re-dispatch what it had (portable backend only).
    """

    dynamicQuant: int = 0
    attn_ranks_per_dp: int = 1
    async_moe_ubatching: bool = False
    async_moe_num_ubatches: int = 2
    async_moe_split: Literal["request", "token"] = "request"
    backend: Literal["auto", "portable", "ascend"] = "auto"
    expert_replicas: int = 1


def _reject(key: str, value: object, why: str) -> AFDConfigError:
    return AFDConfigError(f"{key}={value!r} {why}", key=key, value=value)


class CAMAsyncAFDConnector(AsyncDispatchConnector):
    """Async CAM dispatch/combine connector; see the module docstring."""

    name = "CAMAsyncAFDConnector"
    raw_baselines: ClassVar[Mapping[str, str | None]] = {"gloo": None}
    capabilities: ClassVar[ConnectorCapabilities] = ConnectorCapabilities(
        devices=frozenset({"cpu", "cuda", "npu"}),
        world_layout="attention_first",
        attention_lt_ffn=True,
        supports_extras=False,
        async_dispatch=True,
        dtypes=COMMON_DTYPES,
    )
    extra_config_schema = CamAsyncExtraConfig

    @classmethod
    def validate_config(cls, config: AFDConfig) -> None:
        if config.num_attention_ranks < 1 or config.num_ffn_ranks < 1:
            raise _reject("num_ffn_ranks", config.num_ffn_ranks, "and num_attention_ranks must both be >= 1")
        if config.ffn_hosts is not None:
            raise _reject(
                "afd.ffn_hosts",
                list(config.ffn_hosts),
                "is not used by CAMAsyncAFDConnector: its world meets at afd.host (attention rank 0's address) and "
                "every rank reaches it from its own host; expected afd.ffn_hosts unset and afd.host set",
            )
        replicas = cls.parse_extra_config(config.connector_extra_config).expert_replicas  # type: ignore[attr-defined]
        if replicas < 1 or config.num_ffn_ranks % replicas:
            raise _reject(
                f"{_KEY}.expert_replicas",
                replicas,
                f"must be >= 1 and divide num_ffn_ranks={config.num_ffn_ranks} (groups of that many FFN ranks hold "
                "the same experts)",
            )
        if replicas > 1 and config.num_stages != 1:
            raise _reject(
                f"{_KEY}.expert_replicas",
                replicas,
                f"needs num_stages=1 (got {config.num_stages}): a re-dispatch on one micro-batch stage would wait "
                "behind the FFN rank's turn on another; use expert_replicas=1 with micro-batch stages",
            )
        if not config.compute_gate_on_attention:
            raise _reject(
                "compute_gate_on_attention",
                False,
                "does not fit CAMAsyncAFDConnector: Attention runs the router and dispatches routed experts; set true",
            )
        extra = cls.parse_extra_config(config.connector_extra_config)
        assert isinstance(extra, CamAsyncExtraConfig)
        if extra.attn_ranks_per_dp < 1 or config.num_attention_ranks % extra.attn_ranks_per_dp:
            raise _reject(
                f"{_KEY}.attn_ranks_per_dp",
                extra.attn_ranks_per_dp,
                f"must be >= 1 and divide num_attention_ranks={config.num_attention_ranks}",
            )
        if extra.async_moe_ubatching:
            if extra.async_moe_num_ubatches < 2:
                raise _reject(f"{_KEY}.async_moe_num_ubatches", extra.async_moe_num_ubatches, "must be >= 2")
            if config.num_stages != extra.async_moe_num_ubatches:
                raise _reject(
                    "num_stages",
                    config.num_stages,
                    f"must equal {_KEY}.async_moe_num_ubatches={extra.async_moe_num_ubatches} with async_moe_ubatching",
                )
        elif config.num_stages != 1:
            raise _reject(
                "num_stages",
                config.num_stages,
                f"needs {_KEY}.async_moe_ubatching=true (and async_moe_num_ubatches={config.num_stages}); expected 1",
            )

    @classmethod
    def world_for(cls, config: AFDConfig, moe: MoELayout | None = None) -> World:
        """The attention-first world, each expert on ``connector_extra_config.expert_replicas`` FFN ranks."""
        if moe is None:
            return super().world_for(config, moe)
        extra = cls.parse_extra_config(config.connector_extra_config)
        assert isinstance(extra, CamAsyncExtraConfig)
        return build_world(
            "attention_first",
            config.num_attention_ranks,
            config.num_ffn_ranks,
            num_experts=moe.num_experts,
            expert_replicas=extra.expert_replicas,
        )

    @classmethod
    def stage_extra_config(cls, num_stages: int) -> dict[str, Any]:
        """More than one stage is upstream's async MoE micro-batching."""
        return {"async_moe_ubatching": True, "async_moe_num_ubatches": num_stages} if num_stages > 1 else {}

    def __init__(self, context: ConnectorContext) -> None:
        super().__init__(context)
        assert isinstance(self.world, AttentionFirstWorld)
        self.device_type = context.device.split(":", 1)[0]
        # "npu" is a torch device type only once torch_npu is imported (by the ascend backend's init)
        self.device: Any = context.device if self.device_type == "npu" else torch.device(context.device)
        self.dtype = dtype_from_name(context.model.dtype)
        self.hidden_size = context.model.hidden_size
        self.backend_name = self._pick_backend()
        self.backend: CamBackend = self._make_backend()
        self._topk = self.moe.top_k
        # stage -> FIFO of (layer, tokens, topk_ids, topk_weights, backend handle) awaiting recv_ffn_output
        self._pending: dict[int, collections.deque[tuple[int, int, torch.Tensor, torch.Tensor, Any]]] = {
            s: collections.deque() for s in range(self.config.num_stages)
        }
        #: the peers' heartbeats while the world is open (``None`` before ``init`` and after ``close``)
        self.liveness: StoreHeartbeat | None = None
        self._drain_requested = False
        #: an attention rank's FFN ranks routed around (``expert_replicas`` > 1; read by ``/metrics``): ``failovers``
        #: counts them, ``stall`` the seconds each re-dispatch took; ``None`` without redundant experts
        self.failover_stats: FailoverStats | None = (
            FailoverStats(self.world.expert_replicas)
            if self.role == "attention" and self.world.expert_replicas > 1
            else None
        )

    # --- backend choice (no resources) -----------------------------------------

    def _pick_backend(self) -> str:
        from afd_connectors.cam.ascend import ascend_missing

        extra: CamAsyncExtraConfig = self.extra
        want = extra.backend
        missing = ascend_missing() if want != "portable" and (want == "ascend" or self.device_type == "npu") else None
        if want == "auto":
            want = "ascend" if self.device_type == "npu" and missing is None else "portable"
        if want == "ascend" and missing is not None:
            raise _reject(f"{_KEY}.backend", "ascend", f"needs {missing}; use 'portable' (or 'auto') on this machine")
        if want == "portable":
            if self.device_type not in ("cpu", "cuda"):
                raise _reject(
                    f"{_KEY}.backend",
                    "portable",
                    f"moves cpu (Gloo) or cuda (NCCL) tensors, not {self.device_type}; use 'ascend'",
                )
            if extra.dynamicQuant != 0:
                raise _reject(
                    f"{_KEY}.dynamicQuant",
                    extra.dynamicQuant,
                    "is a CAM operator feature; the portable backend moves unquantised activations: use 0",
                )
        elif extra.expert_replicas != 1:
            raise _reject(
                f"{_KEY}.expert_replicas",
                extra.expert_replicas,
                "needs the portable backend (the CAM operators place each expert on one FFN rank); use 1",
            )
        elif self.moe.num_experts % self.config.num_ffn_ranks:
            raise _reject(
                "num_ffn_ranks",
                self.config.num_ffn_ranks,
                f"must divide the {self.moe.num_experts} routed experts on the ascend backend (the CAM operators "
                "place the same number of experts on every FFN rank); use backend 'portable' for uneven placement",
            )
        return want

    def _make_backend(self) -> CamBackend:
        if self.backend_name == "ascend":
            from afd_connectors.cam.ascend import AscendCamBackend

            return AscendCamBackend(self)
        from afd_connectors.cam.portable import PortableCamBackend

        return PortableCamBackend(self)

    # --- lifecycle ---------------------------------------------------------------

    def open(self) -> None:
        self.backend.init()
        if self.backend_name != "portable":  # the CAM operators' own waits; no store of this world to beat through
            return
        w, cfg = self.world, self.config
        peers = (
            {w.global_rank("ffn", f): f"ffn rank {f}" for f in range(w.num_ffn)}
            if self.role == "attention"
            else {w.global_rank("attention", a): f"attention rank {a}" for a in range(w.num_attention)}
        )
        self.liveness = StoreHeartbeat(
            host=cfg.host,
            port=cfg.port,
            namespace=f"afd-cam/{cfg.port}",
            me=self.world_rank,
            peers=peers,
            timeout_s=cfg.timeout_s,
            owner=self.name,
            watch_fence=self.role == "ffn" and w.expert_replicas > 1,
            watch_drains=self.role == "attention" and w.expert_replicas > 1,
            incarnation=getattr(self.backend, "incarnation", 0),
        )
        if self._drain_requested:
            self.liveness.announce_drain()
        self.liveness.start()

    def release(self) -> None:
        try:
            self.backend.close()  # an attention rank's goodbye goes out while its heartbeat still beats
        finally:
            liveness, self.liveness = self.liveness, None
            if liveness is not None:
                liveness.stop()
            for q in self._pending.values():
                q.clear()

    def drain_refusal(self) -> str | None:
        """``None`` when this world can be drained (:class:`afd_sdk.runtime.drain.Drain`), else why not."""
        if self.role != "ffn" or self.world.expert_replicas < 2:
            return (
                f"drain is not supported by {self.name} with connector_extra_config.expert_replicas="
                f"{self.world.expert_replicas}: routed dispatch drains an FFN rank by routing its experts to "
                "their other holders; expected expert_replicas > 1"
            )
        if self.backend_name != "portable":
            return f"drain is not supported by {self.name}'s {self.backend_name} backend; expected 'portable'"
        return None

    def request_stop(self) -> None:
        """FFN side: drain this rank (any thread, any time): the attention ranks route its experts to their
        other holders at their next dispatch and say goodbye once nothing of theirs is in flight here; then
        ``recv_ffn_work_item`` returns ``None`` as at any orderly end."""
        self._drain_requested = True
        liveness = self.liveness
        if liveness is not None:
            liveness.announce_drain()

    def lost_peers(self) -> tuple[LostPeer, ...]:
        """The peers whose heartbeats stopped (:mod:`afd_connectors.cam.liveness`), also while the world idles.

        ``address`` is the world's store (attention rank 0's ``afd.host:afd.port``), where the heartbeats meet.
        """
        liveness = self.liveness
        if liveness is None:
            return ()
        lost = liveness.lost()
        w = self.world
        if lost and self.role == "attention" and w.expert_replicas > 1:
            # FFN ranks whose experts all have another live holder are routed around at the next dispatch
            gone = {rank - w.num_attention for rank in liveness.lost_ranks()} | self._routed_around()
            if None not in w.routing(gone):
                return ()
        return tuple(LostPeer(name, liveness.address, silent) for name, silent in lost)

    def _routed_around(self) -> frozenset[int]:
        """The FFN ranks this attention rank routes around already (any thread; the portable backend's)."""
        routing = getattr(self.backend, "routing", None)
        return frozenset() if routing is None else routing.lost_snapshot

    # --- attention side ------------------------------------------------------------

    def _stage(self, stage_idx: int) -> collections.deque[tuple[int, int, torch.Tensor, torch.Tensor, Any]]:
        self.check_stage(stage_idx)
        return self._pending[stage_idx]

    def send_attn_output(
        self,
        hidden_states: torch.Tensor,
        metadata: TransferMetadata,
        *,
        topk_ids: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        extras: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.require_role("attention", "send_attn_output")
        q = self._stage(metadata.stage_idx)
        n = self.check_attn_send(hidden_states, metadata)
        if extras:
            raise ConnectorError(f"{self.name} carries no FFN extras; got {sorted(extras)}")
        if topk_ids is None or topk_weights is None:
            raise ConnectorError(f"{self.name}.send_attn_output needs topk_ids and topk_weights (routed dispatch)")
        k = self._topk
        if tuple(topk_ids.shape) != (n, k) or tuple(topk_weights.shape) != (n, k):
            raise ConnectorError(
                f"topk_ids {list(topk_ids.shape)} / topk_weights {list(topk_weights.shape)}; expected [{n}, {k}] "
                f"(tokens × top_k)"
            )
        if topk_ids.dtype not in (torch.int64, torch.int32):
            raise ConnectorError(f"topk_ids dtype {topk_ids.dtype}; expected int64 or int32 expert ids")
        if hidden_states.dtype != self.dtype or hidden_states.device.type != self.device_type:
            raise ConnectorError(
                f"hidden_states is {hidden_states.dtype} on {hidden_states.device}; "
                f"expected {self.dtype} on {self.device}"
            )
        if n and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= self.moe.num_experts):
            raise ConnectorError(f"topk_ids outside [0, {self.moe.num_experts}): the model has that many experts")
        ids = topk_ids.long()
        handle = self.backend.dispatch(hidden_states, ids, topk_weights, metadata.layer_idx, metadata.stage_idx)
        q.append((metadata.layer_idx, n, ids, topk_weights, handle))

    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        self.require_role("attention", "recv_ffn_output")
        q = self._stage(stage_idx)
        if not q:
            raise ConnectorError(f"recv_ffn_output(stage_idx={stage_idx}) without a preceding send_attn_output")
        layer, n, ids, weights, handle = q.popleft()
        if tuple(ref_tensor.shape) != (n, self.hidden_size):
            raise ConnectorError(f"ref_tensor shape {list(ref_tensor.shape)}; expected [{n}, {self.hidden_size}]")
        return self.backend.combine(ref_tensor, ids, weights, layer, stage_idx, handle)

    # --- ffn side ----------------------------------------------------------------------

    def recv_ffn_work_item(self, stage_idx: int = 0) -> FFNWorkItem | None:
        self.require_role("ffn", "recv_ffn_work_item")
        self._stage(stage_idx)
        return self.backend.recv_work_item(stage_idx)

    def send_ffn_work_item_output(self, item: FFNWorkItem, output: torch.Tensor) -> None:
        self.require_initialized()
        self.require_role("ffn", "send_ffn_work_item_output")
        if output.dim() != 2 or output.shape[0] != item.num_tokens or output.shape[1] != self.hidden_size:
            raise ConnectorError(
                f"work item output shape {list(output.shape)}; expected [{item.num_tokens}, {self.hidden_size}]"
            )
        self.backend.send_work_item_output(item, output)

    # --- for backends ----------------------------------------------------------------------

    @property
    def world_rank(self) -> int:
        return self.world.global_rank(self.role, self.role_rank)

    def local_experts(self) -> range:
        """FFN side: this rank's expert ids."""
        return self.world.local_experts(self.role_rank)

    def describe(self) -> dict[str, Any]:
        """What both sides must agree on besides the model fingerprint (compared at handshake)."""
        return {
            "num_experts": self.moe.num_experts,
            "top_k": self.moe.top_k,
            "moe_layers": list(self.moe.moe_layers),
            "backend": self.backend_name,
        }
