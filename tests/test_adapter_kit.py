"""The adapter kit cannot pass a broken adapter: an FFN block that returns a tuple (gpt-oss's
``(hidden_states, router_scores)``) fails it unless the binding declares the output mapping.

The adapter is the guide's worked example (``docs/examples/gpt_oss_adapter.py``), written as an
outside author would for an architecture the SDK does not ship, and registered in-process like an
installed distribution.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

from afd_sdk import ConnectorError, TensorOutput, TupleOutput, hookimpl
from afd_sdk.plugins import get_plugin_manager
from afd_sdk.testing.adapters import AdapterConformance

transformers = pytest.importorskip("transformers", reason="the kit runs transformers models")
if not hasattr(transformers, "GptOssForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no GptOssForCausalLM", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs" / "examples"))
import gpt_oss_adapter as example  # noqa: E402

ARCH = example.ARCHITECTURE


class Kit(AdapterConformance):
    architectures = (ARCH,)


@pytest.fixture
def register(fresh_plugins, monkeypatch):
    """Register the example adapter, with its binding's output mapping replaced by ``output``."""

    def with_output(output):
        real = example.transformers_binding

        def binding(adapter):
            b = real(adapter)
            b.ffn_output = output
            return b

        monkeypatch.setattr(example, "transformers_binding", binding)
        get_plugin_manager().register_plugin(
            types.SimpleNamespace(afd_register_model_adapters=hookimpl(lambda register: register(ARCH, example.GptOssAdapter))),
            "gpt-oss-example",
        )  # fmt: skip

    return with_output


def test_the_block_really_returns_a_tuple():
    cfg = example.GptOssAdapter.tiny_hf_config(ARCH)
    model = transformers.GptOssForCausalLM(transformers.AutoConfig.for_model(**cfg)).eval()
    out = model.model.layers[0].mlp(torch.zeros(1, 3, 32))
    assert isinstance(out, tuple) and len(out) == 2


def test_kit_fails_a_tuple_returning_block_without_an_output_mapping(register, tmp_path):
    register(TensorOutput())  # what a binding that declares nothing gets
    kit = Kit()
    kit.test_loaded_parameters_equal_native(tmp_path / "a")  # the parameter checks alone cannot see it
    with pytest.raises(ConnectorError, match=r"layer 0 returned tuple; expected a tensor.*TupleOutput"):
        kit.test_split_forward_equals_native(tmp_path / "b")


def test_kit_passes_the_worked_example(register, tmp_path):
    register(TupleOutput(index=0, arity=2))  # as the example declares it
    kit = Kit()
    for check in sorted(n for n in dir(kit) if n.startswith("test_")):
        getattr(kit, check)(tmp_path / check)


def test_a_wrong_mapping_fails_too(register, tmp_path):
    register(TupleOutput(index=1, arity=2))  # the router scores are no hidden states
    with pytest.raises(ConnectorError, match="layer 0 returned"):
        Kit().test_split_forward_equals_native(tmp_path)
