"""Adapter conformance inside real vLLM: the checks a model adapter's vLLM binding must pass.

Run it where vLLM is installed (this project's ``.venv-vllm``; the tests skip, saying why, elsewhere). Subclass
:class:`VllmAdapterConformance` and list the architectures::

    class TestMyAdapterInVllm(VllmAdapterConformance):
        architectures = ("MyMoeForCausalLM",)

For each architecture it builds a seeded checkpoint from the adapter's ``tiny_hf_config`` with the binding's
``tiny_overrides`` (what vLLM's CPU kernels need), then runs one real world: the FFN role on vLLM's own FFN
modules built from the binding (``afd ffn serve --engine vllm``), the Attention role as an ``AFD<arch>`` model
in vLLM's engine, and a native vLLM engine on the same checkpoint and prompts. It checks:

* **the binding is declared**: ``bindings["vllm"]`` returns a ``VllmBinding``, the architecture has an
  ``AFD<arch>`` alias in ``vllm_models``, and both roles' configs validate;
* **both roles build and the split matches native**: every rank succeeds, the greedy tokens equal native and
  the logprobs are within ``LOGPROB_TOLERANCE``;
* **the cut**: the Attention model has a parameter-free proxy at every decoder layer's FFN and no FFN
  parameter, and none of the replaced FFN modules' tensors is reachable from anywhere in the process (vLLM's
  MoE bookkeeping and layer registry included: weak references taken before the cut must all be dead); the
  FFN model has FFN parameters only, no attention module and no proxy;
* **gate on Attention** (when the binding declares ``build_local_experts`` and ``routed = True``): the same
  over the routed-dispatch connector, with routed-expert proxies on Attention and the experts on FFN.

A binding error (a wrong ``inner_class``, a missing ``inner_attrs`` key, a ``build_ffn`` that builds another
module than the native layer) fails the split with the rank's error message. Each architecture's world runs
once per class (a minute or two on a CPU) and every check reads its summary.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

__all__ = ["VllmAdapterConformance"]

#: subclass -> (architecture, connector) -> the summary of its one world (plain fixtures work on every pytest 8)
_RUNS: dict[type, dict[tuple[str, str], dict[str, Any]]] = {}


def _failures(summary: dict[str, Any]) -> str:
    return "\n".join(f"{e['role']} {e['rank']}: {e['error_type']}: {e['error']}" for e in summary["errors"])


class VllmAdapterConformance:
    """Subclass it with ``architectures``; see the module docstring for what each test checks."""

    #: the architectures to check (each needs a ``tiny_hf_config`` and a vLLM binding)
    architectures: ClassVar[tuple[str, ...]] = ()
    #: the connector of the default split (point to point; any conformant one)
    connector: ClassVar[str] = "zmq"
    #: also run gate on Attention over ``routed_connector`` where the binding offers it
    routed: ClassVar[bool] = False
    routed_connector: ClassVar[str] = "CAMAsyncAFDConnector"
    #: greedy tokens per prompt
    max_new_tokens: ClassVar[int] = 6

    @pytest.fixture
    def vllm_available(self) -> None:
        pytest.importorskip("vllm", reason="vLLM is not installed here; the vLLM adapter kit runs where it is")

    @pytest.fixture
    def runs(self, vllm_available: None) -> dict[tuple[str, str], dict[str, Any]]:
        """Each (architecture, connector) world runs once per subclass: the summaries, shared by its tests."""
        return _RUNS.setdefault(type(self), {})

    def _run(self, runs: dict[tuple[str, str], dict[str, Any]], arch: str, connector: str) -> dict[str, Any]:
        key = (arch, connector)
        if key not in runs:
            from afd_sdk.integrations.vllm.demo import run_split_vllm

            runs[key] = run_split_vllm(arch=arch, connector=connector, max_new_tokens=self.max_new_tokens)
        return runs[key]

    def _binding(self, arch: str) -> Any:
        from afd_sdk.plugins import get_plugin_manager

        adapter_cls = get_plugin_manager().adapter_class(arch)
        tiny = adapter_cls.tiny_hf_config(arch)
        assert tiny is not None, f"{adapter_cls.__name__}.tiny_hf_config({arch!r}) returned None; the kit needs one"
        return adapter_cls(arch, tiny), tiny

    def _layers(self, tiny: dict[str, Any]) -> int:
        return int((tiny.get("text_config") or tiny)["num_hidden_layers"])

    # --- the checks --------------------------------------------------------------------------------------

    def test_binding_is_declared(self, vllm_available: None) -> None:
        assert self.architectures, "list the architectures to check: architectures = ('MyMoeForCausalLM',)"
        from afd_sdk.adapter import afd_alias
        from afd_sdk.integrations.vllm import VllmBinding

        for arch in self.architectures:
            adapter, _ = self._binding(arch)
            assert adapter.bindings.get("vllm"), f"{type(adapter).__name__} declares no bindings['vllm']"
            binding = adapter.binding("vllm")
            assert isinstance(binding, VllmBinding), f"bindings['vllm'] returned {type(binding).__name__}"
            assert arch in adapter.vllm_models, f"{arch} has no alias class in vllm_models ({afd_alias(arch)})"

    def test_split_matches_native(self, runs: dict[tuple[str, str], dict[str, Any]]) -> None:
        for arch in self.architectures:
            s = self._run(runs, arch, self.connector)
            assert not s["errors"], f"{arch}:\n{_failures(s)}"
            assert s["match"] and s["tokens_equal"], (arch, s["ranks"])

    def test_attention_role_holds_proxies_and_no_ffn_parameter(
        self, runs: dict[tuple[str, str], dict[str, Any]]
    ) -> None:
        for arch in self.architectures:
            s = self._run(runs, arch, self.connector)
            assert not s["errors"], f"{arch}:\n{_failures(s)}"
            adapter, tiny = self._binding(arch)
            layers = self._layers(tiny)
            on_meta = bool(adapter.binding("vllm").ffn_classes)
            for rank in s["ranks"]:
                cut = rank["cut"]
                assert cut["remote_ffn"] == layers, (arch, cut)
                assert cut["ffn_params"] == 0 and cut["attention_modules"] > 0, (arch, cut)
                # no replaced FFN tensor reachable from anywhere (vLLM's MoE bookkeeping, its layer registry)
                assert cut["replaced_tensors"] > 0, (arch, cut)
                assert cut["replaced_tensors_alive"] == 0 and cut["replaced_bytes_alive"] == 0, (arch, cut)
                # a binding that declares its FFN classes has them built on the meta device: never allocated
                assert not on_meta or cut["replaced_bytes_allocated"] == 0, (arch, cut)

    def test_ffn_role_holds_ffn_parameters_only(self, runs: dict[tuple[str, str], dict[str, Any]]) -> None:
        for arch in self.architectures:
            s = self._run(runs, arch, self.connector)
            assert not s["errors"], f"{arch}:\n{_failures(s)}"
            (ffn,) = s["ffn_serve"]
            cut = ffn["cut"]
            assert cut["ffn_params"] > 0 and cut["other_params"] == 0, (arch, cut)
            assert cut["attention_modules"] == 0 and cut["remote_ffn"] == 0, (arch, cut)

    def test_gate_on_attention_matches_native(self, runs: dict[tuple[str, str], dict[str, Any]]) -> None:
        offered = [a for a in self.architectures if self._binding(a)[0].binding("vllm").build_local_experts]
        if not self.routed or not offered:
            pytest.skip("routed = False, or no listed architecture's binding declares build_local_experts")
        for arch in offered:
            s = self._run(runs, arch, self.routed_connector)
            assert not s["errors"], f"{arch}:\n{_failures(s)}"
            assert s["match"] and s["tokens_equal"], (arch, s["ranks"])
            for rank in s["ranks"]:
                cut = rank["cut"]
                assert cut["remote_experts"] > 0 and cut["expert_params"] == 0, (arch, cut)
                assert cut["replaced_tensors"] > 0 and cut["replaced_tensors_alive"] == 0, (arch, cut)
