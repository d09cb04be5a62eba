"""The vLLM adapter kit (afd_sdk.testing.VllmAdapterConformance) on a bundled adapter, and a broken binding
caught with the key to fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed here; run the tier with scripts/bootstrap-vllm.sh (tests/vllm_tier)"
)

from afd_sdk.testing import VllmAdapterConformance


class TestQwenBindingInVllm(VllmAdapterConformance):
    architectures = ("Qwen3MoeForCausalLM",)


def test_a_binding_missing_an_inner_attr_fails_naming_the_key(tmp_path):
    """DeepSeek-V2's binding without ``inner_attrs``: its native load_weights reads ``config``; the FFN role
    must fail with AFDConfigError naming VllmBinding.inner_attrs, not a bare AttributeError from vLLM."""
    code = textwrap.dedent(
        """
        import dataclasses, json
        import afd_models_deepseek.vllm_binding as vb
        from afd_sdk.checkpoints import save_tiny_checkpoint
        from afd_sdk.errors import AFDConfigError
        from afd_sdk.integrations.vllm.ffn import open_ffn_role
        from afd_sdk.plugins import get_plugin_manager

        arch = "DeepseekV2ForCausalLM"
        original = vb.vllm_binding
        vb.vllm_binding = lambda adapter: dataclasses.replace(original(adapter), inner_attrs=lambda cfg, layers: {})
        adapter_cls = get_plugin_manager().adapter_class(arch)
        binding = original(adapter_cls(arch, adapter_cls.tiny_hf_config(arch)))
        model_dir = save_tiny_checkpoint(arch, "CKPT", overrides=binding.tiny_overrides)
        try:
            open_ffn_role(str(model_dir), {"connector": "zmq", "port": 29999, "host": "127.0.0.1"},
                          dtype=binding.cpu_dtype)
            result = {"error": None}
        except AFDConfigError as exc:
            result = {"error": str(exc), "key": exc.key, "value": exc.value}
        print("RESULT " + json.dumps(result))
        """
    ).replace("CKPT", str(tmp_path / "ckpt"))
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"), "VLLM_LOGGING_LEVEL": "ERROR"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, f"rc={res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["key"] == "VllmBinding.inner_attrs", result
    assert "load_weights reads attribute" in result["error"] and "inner_attrs" in result["error"], result
