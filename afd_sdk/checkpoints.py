"""Seeded tiny checkpoints of any registered architecture, for ``afd demo``, the benchmarks, the test kits and
the tests: the adapter's tiny transformers config with random weights, saved as safetensors.

It sits below the runtime and both integrations (each of them imports it; it imports neither). transformers is
imported lazily, inside the functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from afd_sdk.errors import AFDConfigError

__all__ = ["quiet_transformers", "save_tiny_checkpoint"]


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers prints a MISSING table for the other role's keys; that is by design here."""
    from transformers.utils import logging as hf_logging

    old = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(old)
        hf_logging.enable_progress_bar()


def save_tiny_checkpoint(
    architecture: str, out_dir: str | Path, *, seed: int = 0, overrides: Mapping[str, Any] | None = None
) -> Path:
    """Build the adapter's tiny config of ``architecture`` with seeded random weights; save it as safetensors.

    Used by ``afd demo``, the benchmarks and the tests; milliseconds on a CPU.
    ``overrides`` change config fields (what an engine's kernels need, e.g. a
    :class:`~afd_sdk.integrations.vllm.VllmBinding`'s ``tiny_overrides``).
    """
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
    tiny = {**tiny, **(overrides or {})}
    config = AutoConfig.for_model(tiny.pop("model_type"), **tiny)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with quiet_transformers():
        model.save_pretrained(str(out))
    return out
