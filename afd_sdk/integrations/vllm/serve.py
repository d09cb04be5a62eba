"""``vllm serve`` with AFD: the attention role's command line, and a tiny checkpoint with a real tokenizer.

The attention role is plain ``vllm serve`` (vLLM's OpenAI-compatible API
server, scheduler and KV cache) running the ``AFD<arch>`` alias; the FFN role
is ``afd ffn serve --engine vllm`` (see :mod:`~afd_sdk.integrations.vllm.ffn`
for why). :func:`serve_argv` spells the attention command from the same
settings :func:`~afd_sdk.integrations.vllm.ffn.engine_kwargs` gives
``vllm.LLM``, so the two launch paths cannot drift apart.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from afd_sdk.errors import AFDConfigError
from afd_sdk.integrations.vllm.ffn import engine_kwargs
from afd_sdk.weights import read_hf_config

__all__ = ["SERVE_DEFAULTS", "save_serving_checkpoint", "serve_argv"]

#: what every AFD ``vllm serve`` needs beyond the LLM settings. vLLM's default ``--shutdown-timeout 0`` turns
#: SIGTERM into an immediate force-kill of the engine's processes: the worker holding the connector never runs
#: its exit path, and the FFN side sees a lost peer instead of a goodbye. With a drain window the worker gets
#: vLLM's own SIGTERM (after ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``, 5 s) and says goodbye on its way out.
SERVE_DEFAULTS: Mapping[str, Any] = {"shutdown_timeout": 10}


def _flag(key: str, value: Any) -> list[str]:
    name = "--" + key.replace("_", "-")
    if value is True:
        return [name]
    if value is False or value is None:
        return []
    if isinstance(value, (Mapping, list, tuple)):
        return [name, json.dumps(value, separators=(",", ":"))]
    return [name, str(value)]


def serve_argv(
    model_dir: str | Path,
    afd: Mapping[str, Any] | None,
    *,
    port: int,
    architecture: str | None = None,
    dtype: str = "float32",
    executable: str = "vllm",
    **overrides: Any,
) -> list[str]:
    """The ``vllm serve`` command (argv) for ``model_dir`` on HTTP ``port``: AFD attention role, or native.

    ``afd`` is the AFD mapping (its role is set to ``attention``); ``None``
    gives the native server with the same engine settings (the reference).
    ``overrides`` are further engine arguments by their ``EngineArgs`` name
    (``max_model_len=128`` → ``--max-model-len 128``).
    """
    if afd is not None:
        role = afd.get("role", afd.get("afd_role", "attention"))
        if role != "attention":
            raise AFDConfigError(
                f"afd.role={role!r} is invalid for `vllm serve`; expected 'attention' (the FFN "
                "role runs as `afd ffn serve --engine vllm`)",
                key="afd.role",
                value=role,
            )
        afd = {**{k: v for k, v in afd.items() if k not in ("role", "afd_role")}, "role": "attention"}
    kw = engine_kwargs(str(model_dir), afd, architecture=architecture, dtype=dtype, **{**SERVE_DEFAULTS, **overrides})
    model = kw.pop("model")
    kw.pop("skip_tokenizer_init")  # the API server tokenizes: a serving checkpoint carries its tokenizer
    argv = [executable, "serve", model, "--port", str(port)]
    for key, value in kw.items():
        argv += _flag(key, value)
    return argv


def save_serving_checkpoint(architecture: str, out_dir: str | Path, *, seed: int = 0) -> Path:
    """A seeded tiny checkpoint sized for vLLM's CPU kernels, with a word-level ``tokenizer.json`` and chat template.

    What ``vllm serve`` needs to answer text prompts: the adapter's tiny config
    with its vLLM binding's overrides (:func:`save_tiny_checkpoint`) plus
    :func:`~afd_sdk.integrations.tokenizer.save_tiny_tokenizer` over the
    model's vocabulary.
    """
    from afd_sdk.checkpoints import save_tiny_checkpoint
    from afd_sdk.integrations.tokenizer import save_tiny_tokenizer
    from afd_sdk.plugins import get_plugin_manager

    adapter_cls = get_plugin_manager().adapter_class(architecture)
    tiny = adapter_cls.tiny_hf_config(architecture)
    if tiny is None:
        raise AFDConfigError(
            f"architecture={architecture!r} has no tiny config to build a checkpoint from",
            key="architecture",
            value=architecture,
        )
    binding = adapter_cls(architecture, tiny).binding("vllm")
    out = save_tiny_checkpoint(architecture, out_dir, seed=seed, overrides=binding.tiny_overrides)
    saved = read_hf_config(out)
    return save_tiny_tokenizer(out, int((saved.get("text_config") or saved)["vocab_size"]))
