"""Seeded tiny random checkpoints for tests and ``afd demo`` (transformers needed)."""

from __future__ import annotations

from pathlib import Path

import torch

from afd_sdk.errors import AFDConfigError

__all__ = ["save_tiny_checkpoint"]


def save_tiny_checkpoint(architecture: str, out_dir: str | Path, *, seed: int = 0) -> Path:
    """Build the adapter's tiny config of ``architecture`` with random weights and save it as safetensors."""
    import transformers
    from transformers import AutoConfig

    from afd_sdk.plugins import get_plugin_manager

    adapter_cls = get_plugin_manager().adapter_class(architecture)
    tiny = adapter_cls.tiny_hf_config(architecture)
    if tiny is None:
        raise AFDConfigError(
            f"architecture={architecture!r} has no tiny transformers config (no native transformers class)",
            key="architecture",
            value=architecture,
        )
    tiny = dict(tiny)
    config = AutoConfig.for_model(tiny.pop("model_type"), **tiny)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    old = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(out))
    finally:
        hf_logging.set_verbosity(old)
        hf_logging.enable_progress_bar()
    return out
