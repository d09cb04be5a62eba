"""Adapter conformance: the checks every model adapter's transformers binding must pass.

Subclass :class:`AdapterConformance` and list the architectures::

    class TestMyAdapters(AdapterConformance):
        architectures = ("MyMoeForCausalLM",)

For each architecture with a tiny config it builds a seeded random checkpoint
and checks: every tensor is classified; each role's filtered load has zero
missing and zero unexpected keys; the roles together cover the checkpoint;
every loaded parameter equals the native model's; the Attention model holds
no FFN parameter and the FFN model nothing else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from afd_sdk.adapter import ModelAdapter, WeightRole

__all__ = ["AdapterConformance", "split_models"]


def split_models(architecture: str, model_dir: Path) -> dict[str, Any]:
    """Load native, Attention and FFN models of a checkpoint through the registered adapter."""
    from afd_sdk.metadata import ContextVarMetadataProvider
    from afd_sdk.plugins import get_plugin_manager
    from afd_sdk.weights import read_checkpoint

    ckpt = read_checkpoint(model_dir)
    adapter: ModelAdapter = get_plugin_manager().adapter_class(architecture)(architecture, ckpt.config or {})
    binding = adapter.binding("transformers")
    attention, att_report = binding.load_role(adapter, model_dir, "attention", provider=ContextVarMetadataProvider())
    ffn, ffn_report = binding.load_role(adapter, model_dir, "ffn")
    return {
        "adapter": adapter,
        "binding": binding,
        "names": ckpt.names,
        "native": binding.load_native(model_dir),
        "attention": attention,
        "ffn": ffn,
        "reports": {"attention": att_report, "ffn": ffn_report},
    }


class AdapterConformance:
    architectures: ClassVar[tuple[str, ...]] = ()

    def _each(self, tmp_path: Path) -> list[tuple[str, dict[str, Any]]]:
        from afd_sdk.integrations.transformers import save_tiny_checkpoint
        from afd_sdk.plugins import get_plugin_manager

        out = []
        for arch in self.architectures:
            if get_plugin_manager().adapter_class(arch).tiny_hf_config(arch) is None:
                continue
            out.append((arch, split_models(arch, save_tiny_checkpoint(arch, tmp_path / arch))))
        if not out:
            pytest.skip(f"none of {self.architectures} has a tiny transformers config (no native class)")
        return out

    def test_role_split_is_complete_and_exact(self, tmp_path: Path) -> None:
        for arch, s in self._each(tmp_path):
            roles = s["adapter"].weight_roles(s["names"])  # raises on any unclassified name
            att, ffn = s["reports"]["attention"], s["reports"]["ffn"]
            assert not att.missing_in_role and not att.unexpected, arch
            assert not ffn.missing_in_role and not ffn.unexpected, arch
            loaded = set(att.loaded) | set(ffn.loaded)
            expected = {n for n, r in roles.items() if r is not WeightRole.NONE}
            assert loaded == expected, f"{arch}: roles together must cover the checkpoint"
            both = {n for n, r in roles.items() if r is WeightRole.BOTH}
            assert set(att.loaded) & set(ffn.loaded) == both, arch

    def test_loaded_parameters_equal_native(self, tmp_path: Path) -> None:
        for arch, s in self._each(tmp_path):
            native = s["native"].state_dict()
            layers_path = s["binding"].layers_path
            ffn_attr = s["binding"].ffn_attr
            att = s["attention"].state_dict()
            assert att, arch
            for key, value in att.items():
                assert f".{ffn_attr}." not in key.removeprefix(layers_path), f"{arch}: attention holds FFN param {key}"
                assert torch.equal(value, native[key]), f"{arch}: attention param {key} differs from native"
            ffn = s["ffn"].state_dict()
            assert ffn, arch
            for key, value in ffn.items():
                _, idx, rest = key.split(".", 2)  # blocks.<i>.<param>
                native_key = f"{layers_path}.{idx}.{ffn_attr}.{rest}"
                assert torch.equal(value, native[native_key]), f"{arch}: ffn param {key} differs from native"
            n_native_ffn = sum(1 for k in native if f".{ffn_attr}." in k)
            assert len(ffn) == n_native_ffn and len(att) + len(ffn) == len(native), arch
