"""gpt-oss (``GptOssForCausalLM``), an architecture afd-sdk does not ship, adapted from outside.

Everything the SDK can derive is left to it: the cut is the usual ``model.layers[i].mlp``, so the
weight roles (the router ``mlp.router`` and the fused experts are the FFN's, every other part of a
layer is Attention's), the routed-expert layout (``num_local_experts``, ``num_experts_per_tok``)
and the transformers binding (class ``GptOssForCausalLM``) need no code.

What is special about gpt-oss is declared: its FFN block (``GptOssMLP``) returns
``(hidden_states, router_scores)`` and its decoder layer unpacks two values, so only item 0 crosses
the wire and the Attention side hands the layer ``(hidden_states, None)``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from afd_gpt_oss import __version__
from afd_sdk import Deployment, ModelAdapter, TupleOutput

ARCHITECTURE = "GptOssForCausalLM"


class GptOssAdapter(ModelAdapter):
    """gpt-oss: each decoder layer's ``mlp`` (router + fused experts) is the FFN; the rest is Attention."""

    name = "gpt-oss-example"
    version = __version__  # part of the handshake fingerprint: both roles must run the same adapter version
    architectures: ClassVar[tuple[str, ...]] = (ARCHITECTURE,)
    ffn_output = TupleOutput(index=0, arity=2)

    def validate_deployment(self, d: Deployment) -> None:
        # the router hands its experts dense [tokens, experts] scores, not the top-k weights the
        # routed-dispatch proxy carries: the gate stays with the experts on the FFN side
        if d.compute_gate_on_attention:
            raise self.reject("compute_gate_on_attention", True, "False (the router returns dense scores)")
        if d.quantization is not None:  # the published checkpoints are MXFP4; the CPU reference runs bf16/fp32
            raise self.reject("quantization", d.quantization, "an unquantized checkpoint (None)")

    @classmethod
    def tiny_hf_config(cls, architecture: str) -> dict[str, Any] | None:
        """The kit's and ``afd demo``'s seeded checkpoint: a small config of the architecture."""
        return dict(
            model_type="gpt_oss",
            vocab_size=96,
            hidden_size=32,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=128,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=False,
        )
