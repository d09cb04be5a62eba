"""The guide's worked example, an outside adapter for gpt-oss (``docs/examples/afd-gpt-oss``), as its
author would ship it: a distribution whose entry point registers the adapter.

* Installed (``pip install --target``, in a subprocess that sees it only through its entry point):
  ``afd plugins`` lists it from its own distribution and ``afd demo`` splits it across processes
  and equals native.
* The adapter kit cannot pass a broken adapter: gpt-oss's FFN block returns
  ``(hidden_states, router_scores)``, so without the adapter's ``ffn_output`` declaration (or with a
  wrong one) the kit fails; as shipped it passes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from afd_sdk import ConnectorError, TensorOutput, TupleOutput, hookimpl, register_adapter
from afd_sdk.plugins import get_plugin_manager
from afd_sdk.testing.adapters import AdapterConformance

transformers = pytest.importorskip("transformers", reason="the kit runs transformers models")
if not hasattr(transformers, "GptOssForCausalLM"):
    pytest.skip(f"transformers {transformers.__version__} has no GptOssForCausalLM", allow_module_level=True)

DIST = Path(__file__).resolve().parents[1] / "docs" / "examples" / "afd-gpt-oss"
sys.path.insert(0, str(DIST))
from afd_gpt_oss import adapter as example  # noqa: E402

ARCH = example.ARCHITECTURE


class Kit(AdapterConformance):
    architectures = (ARCH,)


@pytest.fixture
def register(fresh_plugins, monkeypatch):
    """Register the example adapter in-process, with its ``ffn_output`` replaced by ``output``."""

    def with_output(output):
        monkeypatch.setattr(example.GptOssAdapter, "ffn_output", output)
        plugin = types.SimpleNamespace(
            afd_register_model_adapters=hookimpl(lambda register: register_adapter(register, example.GptOssAdapter))
        )
        get_plugin_manager().register_plugin(plugin, "gpt-oss-example")

    return with_output


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The example distribution installed into its own directory, as ``pip install`` would."""
    source, target = tmp_path_factory.mktemp("src") / DIST.name, tmp_path_factory.mktemp("site")
    # built from a copy: setuptools writes egg-info into the source tree, whose entry point this process would see
    shutil.copytree(DIST, source, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target


def afd(installed: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(installed)}  # only the installed copy, not the source tree
    cmd = [sys.executable, "-m", "afd_sdk.cli", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=installed)


def test_installed_distribution_registers_through_its_entry_point(installed):
    out = afd(installed, "plugins", "--json")
    assert out.returncode == 0, out.stderr
    adapters = {a["architecture"]: a for a in json.loads(out.stdout)["model_adapters"]}
    assert ARCH in adapters, sorted(adapters)
    assert adapters[ARCH]["distribution"] == "afd-gpt-oss-example", adapters[ARCH]
    assert adapters[ARCH]["target"] == "afd_gpt_oss.adapter:GptOssAdapter", adapters[ARCH]


def test_installed_distribution_splits_and_equals_native(installed):
    out = afd(installed, "demo", "--arch", ARCH, "--max-new-tokens", "4", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    assert result["match"] is True and result["max_abs_diff"] <= 1e-5, result


def test_the_block_really_returns_a_tuple():
    cfg = example.GptOssAdapter.tiny_hf_config(ARCH)
    model = transformers.GptOssForCausalLM(transformers.AutoConfig.for_model(**cfg)).eval()
    out = model.model.layers[0].mlp(torch.zeros(1, 3, 32))
    assert isinstance(out, tuple) and len(out) == 2


def test_everything_but_the_output_is_derived():
    cfg = {"architectures": [ARCH], **example.GptOssAdapter.tiny_hf_config(ARCH)}
    adapter = example.GptOssAdapter(ARCH, cfg)
    layout = adapter.moe_layout()
    assert (layout.num_experts, layout.top_k, layout.moe_layers) == (4, 2, (0, 1))
    assert adapter.weight_role("model.layers.1.mlp.router.weight").value == "ffn"
    assert adapter.weight_role("model.layers.1.mlp.router.weight", compute_gate_on_attention=True).value == "both"
    assert adapter.weight_role("model.layers.1.self_attn.sinks").value == "attention"
    assert adapter.weight_role("model.layers.2.mlp.experts.gate_up_proj").value == "none"  # past the last layer
    assert adapter.weight_role("model.unknown_tower.weight") is None  # never a silent default


def test_kit_fails_a_tuple_returning_block_without_an_output_mapping(register, tmp_path):
    register(TensorOutput())  # what an adapter that declares nothing gets
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
