"""A model adapter written from outside the SDK: gpt-oss (``GptOssForCausalLM``), which afd-sdk does not ship.

The worked example of ``docs/writing-a-model-adapter.md``; ``tests/test_adapter_kit.py`` registers it
and runs the adapter kit on it. In a real distribution, the binding factory and the adapter live in
your package and a ``[project.entry-points.afd_sdk]`` plugin registers them (see the guide).

What is special about gpt-oss: its FFN block (``GptOssMLP``) returns ``(hidden_states, router_scores)``
and its decoder layer unpacks two values. The binding declares that with
``ffn_output=TupleOutput(index=0, arity=2)``: only the hidden states cross the wire, and on the
Attention side the proxy hands the layer ``(hidden_states, None)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from afd_sdk import Deployment, ModelAdapter, MoELayout, TupleOutput, WeightRole
from afd_sdk.weights import LayerRules

ARCHITECTURE = "GptOssForCausalLM"


def transformers_binding(adapter: ModelAdapter) -> Any:
    """``bindings["transformers"]``: the native class, where the layers are, what the FFN block returns."""
    from afd_sdk.integrations.transformers import TransformersBinding

    return TransformersBinding(ARCHITECTURE, layers_path="model.layers", ffn_attr="mlp",
                               ffn_output=TupleOutput(index=0, arity=2))  # fmt: skip


class GptOssAdapter(ModelAdapter):
    """gpt-oss: each decoder layer's ``mlp`` (router + fused experts) is the FFN; the rest is Attention."""

    name = "gpt-oss-example"
    version = "0.1.0"  # part of the handshake fingerprint: both roles must run the same adapter version
    architectures: ClassVar[tuple[str, ...]] = (ARCHITECTURE,)
    bindings: ClassVar[Mapping[str, str]] = {"transformers": "gpt_oss_adapter:transformers_binding"}

    def __init__(self, architecture: str, hf_config: Mapping[str, Any]) -> None:
        super().__init__(architecture, hf_config)
        self.num_layers = int(self.hf_config.get("num_hidden_layers", 0))
        # checkpoint names (what classification sees): model.layers.{i}.mlp.router.*, mlp.experts.gate_up_proj, ...
        self.rules = LayerRules(self.num_layers, lambda i: True, router_prefixes=("mlp.router.",))

    def weight_role(self, name: str, *, compute_gate_on_attention: bool = False) -> WeightRole | None:
        return self.rules.role(name, compute_gate_on_attention=compute_gate_on_attention)

    def moe_layout(self) -> MoELayout | None:
        return MoELayout(int(self.hf_config["num_local_experts"]), int(self.hf_config["num_experts_per_tok"]),
                         tuple(range(self.num_layers)))  # fmt: skip

    def validate_deployment(self, d: Deployment) -> None:
        # gpt-oss's router hands its experts dense [tokens, experts] scores, not the top-k weights the
        # routed-dispatch proxy carries: the gate stays with the experts on the FFN side
        if d.compute_gate_on_attention:
            raise self.reject("compute_gate_on_attention", True, "False (the router returns dense scores)")

    @classmethod
    def tiny_hf_config(cls, architecture: str) -> dict[str, Any] | None:
        """The kit's seeded checkpoint: a small config of the architecture (``model_type`` included)."""
        return dict(
            model_type="gpt_oss", vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=128, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=False,
        )  # fmt: skip
