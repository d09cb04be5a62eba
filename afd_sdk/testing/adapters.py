"""Adapter conformance: the checks every model adapter's transformers binding must pass.

Subclass :class:`AdapterConformance` and list the architectures::

    class TestMyAdapters(AdapterConformance):
        architectures = ("MyMoeForCausalLM",)

For each architecture it builds a seeded random checkpoint from the adapter's
``tiny_hf_config`` (an architecture without one fails, naming it) and checks:

* every tensor is classified; each role's filtered load has zero missing and
  zero unexpected keys; the roles together cover the checkpoint; every loaded
  parameter equals the native model's; the Attention model holds no FFN
  parameter and the FFN model nothing else;
* ``validate_deployment`` accepts the plain CPU deployment the kit runs; for
  each deployment feature set to a non-default value it either accepts or
  raises ``UnsupportedFeatureError`` naming that feature, never another
  exception (which values it must reject is the adapter's own tests' job);
* ``moe_layout()`` matches the model: its MoE layers are exactly the layers
  whose FFN block has routed experts;
* **the split runs**: the Attention model's forward, its FFN proxies answered
  in-process by the FFN role's model (:class:`InProcessFFN`, the same
  proxies, blocks and output mapping a connector would carry), gives the
  native logits for batches of 1, 2 and 3 prompts of different lengths; and,
  where the adapter accepts the gate on Attention, the same with routed
  experts dispatched (:class:`InProcessRoutedExperts`). A block whose output
  is not what the adapter declares (``ffn_output``) fails here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from afd_sdk.adapter import ModelAdapter, WeightRole
from afd_sdk.capabilities import ConnectorCapabilities

__all__ = ["AdapterConformance", "InProcessFFN", "InProcessRoutedExperts", "split_models"]

#: batches of prompts of different lengths (right-padded, with an attention mask)
BATCHES = ((5,), (3, 6), (4, 2, 7))
#: what a routed-dispatch connector declares (gate on Attention is decided by these, never by a name)
ROUTED = ConnectorCapabilities(
    world_layout="attention_first", attention_lt_ffn=True, async_dispatch=True, supports_extras=False
)
#: float32 logits: the FFN role batches every prompt's tokens into one call, which may regroup MoE rows
LOGIT_TOLERANCE = 1e-5


class InProcessFFN:
    """The two Attention-side connector calls, answered in this process by the FFN role's model.

    What a point-to-point connector does across processes, minus the wire: the
    kit puts it in the forward metadata so the binding's proxies, the FFN
    blocks and the output mapping run exactly as in a deployment.
    """

    def __init__(self, ffn: Any) -> None:
        self.ffn = ffn
        self.layers: list[int] = []
        self._pending: tuple[torch.Tensor, Any, dict[str, torch.Tensor]] | None = None

    def send_attn_output(self, hidden_states: torch.Tensor, metadata: Any, *, extras: Any = None) -> None:
        self._pending = (hidden_states.clone(), metadata, dict(extras or {}))

    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        assert self._pending is not None, "recv_ffn_output before send_attn_output"
        x, md, extras = self._pending
        self._pending = None
        self.layers.append(md.layer_idx)
        return self.ffn(md.layer_idx, x, extras)


class InProcessRoutedExperts:
    """Routed dispatch/combine in this process (gate on Attention): what a routed-dispatch connector computes.

    Rows go to their experts grouped by expert id (:class:`~afd_sdk.proxy.RoutedExperts`
    holding every expert), and each row's outputs come back weighted and summed.
    """

    def __init__(self, experts: Any, num_experts: int) -> None:
        self.experts = experts
        self.num_experts = num_experts
        self.layers: list[int] = []
        self._pending: tuple[torch.Tensor, Any, torch.Tensor, torch.Tensor] | None = None

    def send_attn_output(
        self, hidden_states: torch.Tensor, metadata: Any, *, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> None:
        self._pending = (hidden_states.clone(), metadata, topk_ids.clone(), topk_weights.clone())

    def recv_ffn_output(self, ref_tensor: torch.Tensor, stage_idx: int = 0) -> torch.Tensor:
        assert self._pending is not None, "recv_ffn_output before send_attn_output"
        x, md, ids, weights = self._pending
        self._pending = None
        self.layers.append(md.layer_idx)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = torch.arange(x.shape[0]).repeat_interleave(ids.shape[1])[order]
        groups = torch.bincount(flat, minlength=self.num_experts)
        y = self.experts(md.layer_idx, x[rows], groups)
        out = torch.zeros_like(x)
        return out.index_add_(0, rows, y * weights.reshape(-1)[order, None].to(y.dtype))


def split_models(architecture: str, model_dir: Path) -> dict[str, Any]:
    """Load native, Attention and FFN models of a checkpoint through the registered adapter."""
    from afd_sdk.metadata import ContextVarMetadataProvider
    from afd_sdk.plugins import get_plugin_manager
    from afd_sdk.weights import read_checkpoint

    ckpt = read_checkpoint(model_dir)
    adapter: ModelAdapter = get_plugin_manager().adapter_class(architecture)(architecture, ckpt.config or {})
    binding = adapter.binding("transformers")
    provider = ContextVarMetadataProvider()
    attention, att_report = binding.load_role(adapter, model_dir, "attention", provider=provider)
    ffn, ffn_report = binding.load_role(adapter, model_dir, "ffn")
    return {
        "adapter": adapter,
        "binding": binding,
        "names": ckpt.names,
        "native": binding.load_native(model_dir),
        "attention": attention,
        "ffn": ffn,
        "provider": provider,
        "model_dir": model_dir,
        "reports": {"attention": att_report, "ffn": ffn_report},
    }


def _batch(lengths: tuple[int, ...], vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        ids[b, :n] = torch.randint(1, vocab, (n,), generator=g)
        mask[b, :n] = 1
    return ids, mask


def _split_logits(model: Any, provider: Any, loop: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    from afd_sdk.metadata import ForwardMetadata

    n = ids.numel()
    md = ForwardMetadata(
        stage_idx=0,
        num_stages=1,
        stage_token_start=(0,),
        stage_token_len=(n,),
        stage_token_len_padded=(n,),
        request_start=(0,),
        connector=loop,
    )
    with torch.no_grad(), provider.install(md):
        return model(input_ids=ids, attention_mask=mask).logits


def _max_diff(got: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    valid = mask.bool()
    return float((got[valid].float() - ref[valid].float()).abs().max())


class AdapterConformance:
    architectures: ClassVar[tuple[str, ...]] = ()

    def _each(self, tmp_path: Path) -> list[tuple[str, dict[str, Any]]]:
        from afd_sdk.checkpoints import save_tiny_checkpoint
        from afd_sdk.plugins import get_plugin_manager

        out = []
        if not self.architectures:
            pytest.fail(f"{type(self).__name__}.architectures is empty; list the architectures the adapter serves")
        for arch in self.architectures:
            if get_plugin_manager().adapter_class(arch).tiny_hf_config(arch) is None:
                pytest.fail(
                    f"{arch}: the adapter's tiny_hf_config({arch!r}) returned None; the kit builds its "
                    "seeded checkpoint from it (a small config of the architecture, e.g. 3 layers, hidden "
                    "32); leave architectures without a transformers class out of the kit"
                )
            out.append((arch, split_models(arch, save_tiny_checkpoint(arch, tmp_path / arch))))
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

    def test_moe_layout_matches_the_model(self, tmp_path: Path) -> None:
        for arch, s in self._each(tmp_path):
            layout = s["adapter"].moe_layout()
            layers = s["binding"].layers(s["native"])
            routed = tuple(
                i for i, layer in enumerate(layers) if hasattr(getattr(layer, s["binding"].ffn_attr), "experts")
            )
            declared = layout.moe_layers if layout is not None else ()
            assert declared == routed, f"{arch}: moe_layout() declares MoE layers {declared}; the model's are {routed}"
            for i in routed:
                n = getattr(getattr(layers[i], s["binding"].ffn_attr).experts, "num_experts", None)
                assert layout is not None and n in (None, layout.num_experts), (
                    f"{arch}: layer {i} holds {n} experts; moe_layout() declares {layout and layout.num_experts}"
                )

    def test_split_forward_equals_native(self, tmp_path: Path) -> None:
        for arch, s in self._each(tmp_path):
            vocab = int(s["native"].config.get_text_config().vocab_size)
            num_layers = len(s["binding"].layers(s["native"]))
            for seed, lengths in enumerate(BATCHES):
                ids, mask = _batch(lengths, vocab, seed)
                with torch.no_grad():
                    ref = s["native"](input_ids=ids, attention_mask=mask).logits
                loop = InProcessFFN(s["ffn"])
                got = _split_logits(s["attention"], s["provider"], loop, ids, mask)
                assert loop.layers == list(range(num_layers)), f"{arch}: layers crossed {loop.layers}"
                assert got.shape == ref.shape, f"{arch}, batch {lengths}: logits {list(got.shape)} vs {list(ref.shape)}"
                diff = _max_diff(got, ref, mask)
                assert diff <= LOGIT_TOLERANCE, f"{arch}, batch {lengths}: split logits differ from native by {diff:g}"

    def test_gate_on_attention_split_equals_native(self, tmp_path: Path) -> None:
        from afd_sdk.adapter import Deployment
        from afd_sdk.errors import UnsupportedFeatureError
        from afd_sdk.metadata import ContextVarMetadataProvider

        for arch, s in self._each(tmp_path):
            adapter, binding, layout = s["adapter"], s["binding"], s["adapter"].moe_layout()
            if layout is None:
                continue  # a dense model has no routed experts to dispatch
            try:
                adapter.validate_deployment(
                    Deployment(device="cpu", connector="routed", capabilities=ROUTED, compute_gate_on_attention=True)
                )
            except UnsupportedFeatureError:
                continue  # the adapter declares the gate on Attention unsupported (its rejection is what it says)
            provider = ContextVarMetadataProvider()
            attention, _ = binding.load_role(
                adapter, s["model_dir"], "attention", provider=provider, compute_gate_on_attention=True
            )
            experts, _ = binding.load_role(adapter, s["model_dir"], "ffn", compute_gate_on_attention=True)
            vocab = int(s["native"].config.get_text_config().vocab_size)
            for seed, lengths in enumerate(BATCHES):
                ids, mask = _batch(lengths, vocab, seed)
                with torch.no_grad():
                    ref = s["native"](input_ids=ids, attention_mask=mask).logits
                loop = InProcessRoutedExperts(experts, layout.num_experts)
                got = _split_logits(attention, provider, loop, ids, mask)
                assert loop.layers == list(layout.moe_layers), f"{arch}: layers dispatched {loop.layers}"
                diff = _max_diff(got, ref, mask)
                assert diff <= LOGIT_TOLERANCE, f"{arch}, batch {lengths}, gate on Attention: logits differ by {diff:g}"

    #: one non-default value per deployment feature: each must be accepted or rejected by name
    FEATURE_PROBES: ClassVar[tuple[tuple[str, Any], ...]] = (
        ("pipeline_parallel_size", 2),
        ("prefill_context_parallel_size", 2),
        ("decode_context_parallel_size", 2),
        ("sequence_parallel_moe", True),
        ("eplb", True),
        ("speculative_decoding", True),
        ("lora", True),
        ("multimodal", True),
        ("num_stages", 2),
        ("quantization", "fp8"),
        ("moe_backend", "deep_gemm_mega_moe"),
        ("engram", True),
        ("device", "cuda"),
        ("device", "npu"),
    )

    def test_validate_deployment_accepts_the_kit_and_names_what_it_rejects(self, tmp_path: Path) -> None:
        from afd_sdk.adapter import Deployment
        from afd_sdk.errors import UnsupportedFeatureError

        for arch, s in self._each(tmp_path):
            adapter = s["adapter"]
            adapter.validate_deployment(Deployment(device="cpu"))  # what the kit just ran must be servable
            for feature, value in self.FEATURE_PROBES:
                try:
                    adapter.validate_deployment(Deployment(**{"device": "cpu", feature: value}))
                except UnsupportedFeatureError as exc:
                    assert feature in str(exc), f"{arch}: rejecting {feature}={value!r} must name it: {exc}"
