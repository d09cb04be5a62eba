"""``AFDWorkerExtension``: AFD calls on vLLM's workers by name (``LLM.collective_rpc``).

vLLM mixes a ``worker_extension_cls`` into every worker class
(``--worker-extension-cls afd_sdk.integrations.vllm.extension.AFDWorkerExtension``;
:func:`~afd_sdk.integrations.vllm.ffn.engine_kwargs` sets it with AFD on). A
method is then called in each worker with ``llm.collective_rpc("afd_close_connector")``:
only the method's name crosses vLLM's process boundary, so no pickled
callable is needed (``LLM.apply_model`` would need
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in multiprocess mode).
"""

from __future__ import annotations

from typing import Any

__all__ = ["AFDWorkerExtension", "describe_cut"]


def describe_cut(model: Any) -> dict[str, Any]:
    """What one role's model holds at the cut.

    ``remote_ffn`` / ``remote_experts``: parameter-free proxies for whole FFN
    modules / routed experts; ``ffn_params`` / ``other_params``: parameters
    inside / outside the decoder layers' FFN modules; ``expert_params``:
    routed-expert parameters; ``attention_modules``: modules whose class is an
    attention layer. Attention role: ``replaced_tensors`` is how many tensors the
    cut replaced, ``replaced_tensors_alive`` / ``replaced_bytes_alive`` how many of
    them (and their bytes) are still reachable from anywhere in the process
    (vLLM's bookkeeping included); both must be 0. ``replaced_bytes_allocated``:
    bytes of them that were ever allocated (0 when the binding's ``ffn_classes``
    built them on the meta device).
    """
    from afd_sdk.proxy import RemoteExperts, RemoteFFN

    names = [name for name, _ in model.named_parameters()]
    ffn_params = sum(".mlp." in f".{name}" for name in names)
    out = {
        "remote_ffn": sum(isinstance(m, RemoteFFN) for m in model.modules()),
        "remote_experts": sum(isinstance(m, RemoteExperts) for m in model.modules()),
        "expert_params": sum(".mlp.experts." in f".{name}" for name in names),
        "ffn_params": ffn_params,
        "other_params": len(names) - ffn_params,
        "attention_modules": sum("Attention" in type(m).__name__ for m in model.modules()),
        "classes": sorted({type(m).__name__ for m in model.modules()}),
    }
    replaced = getattr(model, "afd_replaced", None)
    if replaced is not None:
        alive, nbytes = replaced.alive()
        out.update(
            replaced_tensors=len(replaced.refs),
            replaced_tensors_alive=alive,
            replaced_bytes_alive=nbytes,
            replaced_bytes_allocated=replaced.allocated_bytes,
        )
    return out


class AFDWorkerExtension:
    """Methods vLLM adds to its worker class; ``self`` is the worker (``self.model_runner.get_model()``)."""

    model_runner: Any

    def afd_close_connector(self) -> bool:
        """Say goodbye to the FFN peers and release the connector; ``False`` when the model is not an AFD alias.

        Called by the operator (or the demo) after the last request, before
        the engine shuts down; the alias also closes it at process exit.
        """
        side = getattr(self.model_runner.get_model(), "afd_attention", None)
        if side is None:
            return False
        side.close()
        return True

    def afd_describe_cut(self) -> dict[str, Any]:
        """:func:`describe_cut` of this worker's model."""
        return describe_cut(self.model_runner.get_model())
