"""The Attention role inside vLLM holds no FFN memory: vLLM's own references to the replaced FFN modules go too.

vLLM builds the native model whole, and the cut then replaces each decoder layer's FFN module with a proxy. A
``setattr`` alone frees nothing: vLLM still references the replaced modules through the native class's
MixtureOfExperts bookkeeping (``moe_layers``; DeepSeek/GLM's ``moe_mlp_layers``) and its layer registry
(``compilation_config.static_forward_context["model.layers.N.mlp.experts"]`` and ``static_all_moe_layers``),
so their routed-expert, gate and shared-expert tensors would stay allocated on every attention rank, memory AFD
exists to give to the KV cache. :func:`drop_vllm_references` removes those references; :func:`track` keeps a
weak reference to every tensor the cut replaced, so :meth:`ReplacedTensors.alive` proves (``afd_describe_cut``,
the tier, ``VllmAdapterConformance``) that none survives. Runs once at construction, never per step.

Freeing after the build still allocates every FFN tensor while vLLM builds the model: on a real MoE an attention
GPU may not hold all experts even briefly. :func:`construct_on_meta` builds the FFN classes a binding declares
(``VllmBinding.ffn_classes``) on the meta device instead, so those tensors are never allocated at all;
:attr:`ReplacedTensors.allocated_bytes` says how many bytes of the replaced tensors were real.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from afd_sdk.adapter import resolve_target

__all__ = ["MOE_BOOKKEEPING", "ReplacedTensors", "construct_on_meta", "drop_vllm_references", "track"]

#: the native model attributes (lists of modules) of vLLM's MixtureOfExperts interface that hold MoE modules
MOE_BOOKKEEPING = ("moe_layers", "moe_mlp_layers")


@dataclass
class ReplacedTensors:
    """Weak references to every tensor of the modules a cut replaced, with their sizes."""

    refs: list[weakref.ref[torch.Tensor]]
    nbytes: list[int]
    #: bytes of those tensors that held memory when the cut replaced them (0: all were built on the meta device)
    allocated_bytes: int = 0

    def without(self, kept: torch.nn.Module) -> ReplacedTensors:
        """Only the tensors ``kept`` (the role's model after the cut) does not hold as its own parameters or
        buffers: a tensor the replaced module shared with a module that stays (DeepSeek's router correction bias,
        owned by the gate on Attention and handed to the experts) was never the FFN's."""
        own = {id(t) for t in (*kept.parameters(), *kept.buffers())}
        kept_real = [(r, n) for r, n in zip(self.refs, self.nbytes, strict=True) if id(r()) in own]
        pairs = [(r, n) for r, n in zip(self.refs, self.nbytes, strict=True) if id(r()) not in own]
        shared = sum(n for r, n in kept_real if (t := r()) is not None and not t.is_meta)
        return ReplacedTensors([r for r, _ in pairs], [n for _, n in pairs], self.allocated_bytes - shared)

    def alive(self) -> tuple[int, int]:
        """``(tensors, bytes)`` of the replaced tensors still reachable from anywhere (after a collection)."""
        gc.collect()
        live = [size for ref, size in zip(self.refs, self.nbytes, strict=True) if ref() is not None]
        return len(live), sum(live)


def track(modules: Iterable[torch.nn.Module]) -> ReplacedTensors:
    """Weak references to the parameters and buffers of ``modules`` (each tensor once), taken before the cut."""
    seen: set[int] = set()
    refs: list[weakref.ref[torch.Tensor]] = []
    nbytes: list[int] = []
    allocated = 0
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            if id(t) not in seen:
                seen.add(id(t))
                refs.append(weakref.ref(t))
                nbytes.append(t.numel() * t.element_size())
                allocated += 0 if t.is_meta else nbytes[-1]
    return ReplacedTensors(refs, nbytes, allocated)


@contextlib.contextmanager
def construct_on_meta(classes: Sequence[str]) -> Iterator[None]:
    """While the block runs, every instance of ``classes`` (``"module:Class"``) is built on the meta device.

    Called by the Attention role around vLLM's native model construction with its binding's ``ffn_classes``:
    the decoder layers' FFN modules, which the cut replaces right after, never allocate their tensors (modules
    built inside them are meta too). Each class's ``__init__`` is wrapped for the block only and restored after,
    also on error; a model is built by one thread. A tensor such an ``__init__`` places on an explicit device
    still allocates: :attr:`ReplacedTensors.allocated_bytes` shows it.
    """
    patched: list[tuple[type, object]] = []
    try:
        for spec in classes:
            cls = resolve_target(spec, what="VllmBinding.ffn_classes")
            own = cls.__dict__.get("__init__")  # None: inherited, so restoring means deleting ours
            cls.__init__ = _on_meta(cls.__init__)  # type: ignore[misc]
            patched.append((cls, own))
        yield
    finally:
        for cls, own in reversed(patched):
            if own is None:
                del cls.__init__  # type: ignore[misc]
            else:
                cls.__init__ = own  # type: ignore[misc]


def drop_vllm_references(
    model: Any, vllm_config: Any, names: Sequence[str], modules: Sequence[torch.nn.Module]
) -> None:
    """Remove vLLM's references to the replaced FFN ``modules`` (qualified ``names`` in the model).

    Called by the Attention role's constructor right after the proxies are placed, while vLLM is still
    building the model: the MoE bookkeeping lists keep only modules still in the model, and the layer registry
    forgets every layer registered under a replaced module's name (its MoE runner, which holds the experts).
    """
    ids = {id(m) for module in modules for m in module.modules()}
    for attr in MOE_BOOKKEEPING:
        held = getattr(model, attr, None)
        if isinstance(held, list):
            held[:] = [m for m in held if id(m) not in ids]
    cc = vllm_config.compilation_config
    prefixes = tuple(f"{n}." for n in names)

    def replaced(key: str) -> bool:
        return key in names or key.startswith(prefixes)

    for key in [k for k in cc.static_forward_context if replaced(k)]:
        del cc.static_forward_context[key]
    moe_names = getattr(cc, "static_all_moe_layers", None)
    if isinstance(moe_names, list):
        moe_names[:] = [k for k in moe_names if not replaced(k)]


def _on_meta(init: Any) -> Any:
    @functools.wraps(init)
    def on_meta(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        with torch.device("meta"):
            init(self, *args, **kwargs)

    return on_meta
