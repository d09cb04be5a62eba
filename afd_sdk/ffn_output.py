"""What crosses the wire from a decoder layer's FFN block, and what the layer gets back.

Declared by a model adapter (``ModelAdapter.ffn_output``), used by both sides of
the cut in every framework binding (:mod:`afd_sdk.proxy`). Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from afd_sdk.errors import ConnectorError

__all__ = ["FFNOutput", "TensorOutput", "TupleOutput"]


class FFNOutput:
    """How a decoder layer's FFN block output maps to the one tensor that crosses the wire, and back.

    A model adapter declares one (:attr:`ModelAdapter.ffn_output
    <afd_sdk.adapter.ModelAdapter.ffn_output>`; :class:`TensorOutput` by
    default) and every binding hands it to both sides of the cut: :class:`FFNBlocks` calls
    :meth:`to_wire` on what the native block returned (FFN role), and
    :class:`RemoteFFN` returns :meth:`from_wire` of the received tensor to the
    decoder layer (Attention role), which then unpacks it as it would the
    native block's output. Declare one for a block that returns more than a
    tensor, e.g. gpt-oss's ``(hidden_states, router_scores)``:
    ``TupleOutput(index=0, arity=2)``.
    """

    def to_wire(self, output: Any, layer_idx: int) -> torch.Tensor:
        """FFN role: the tensor to send back, from the native block's ``output`` (called once per layer)."""
        raise NotImplementedError

    def from_wire(self, tensor: torch.Tensor) -> Any:
        """Attention role: what the decoder layer receives in place of the native block's output."""
        raise NotImplementedError

    def block_result(self, output: Any, x: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """FFN role: :meth:`to_wire` of the block's ``output`` for input ``x``, checked to keep ``x``'s tokens,
        hidden size and dtype (``ConnectorError`` naming the layer otherwise). What every FFN server sends."""
        out = self.to_wire(output, layer_idx)
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ConnectorError(
                f"the FFN block of layer {layer_idx} returned {list(out.shape)} {out.dtype} for {list(x.shape)} "
                f"{x.dtype}; an FFN block must keep the tokens, hidden size and dtype of its input"
            )
        return out


def _not_a_tensor(output: Any, layer_idx: int, expected: str) -> ConnectorError:
    return ConnectorError(
        f"the FFN block of layer {layer_idx} returned {type(output).__name__}; expected {expected}. Declare how its "
        "output maps to the wire on the model adapter: ffn_output = TupleOutput(index=..., arity=...) or your own "
        "FFNOutput"
    )


@dataclass(frozen=True)
class TensorOutput(FFNOutput):
    """The block returns one tensor, the hidden states (every bundled architecture)."""

    def to_wire(self, output: Any, layer_idx: int) -> torch.Tensor:
        if not isinstance(output, torch.Tensor):
            raise _not_a_tensor(output, layer_idx, "a tensor")
        return output

    def from_wire(self, tensor: torch.Tensor) -> Any:
        return tensor


@dataclass(frozen=True)
class TupleOutput(FFNOutput):
    """The block returns a tuple of ``arity`` items whose item ``index`` is the hidden states.

    Only that item crosses the wire; on Attention the other items are ``None``
    (what the decoder layer discards, e.g. router scores kept for an auxiliary loss).
    """

    index: int = 0
    arity: int = 2

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.arity:
            raise ValueError(f"TupleOutput(index={self.index}, arity={self.arity}); expected 0 <= index < arity")

    def to_wire(self, output: Any, layer_idx: int) -> torch.Tensor:
        if not isinstance(output, (tuple, list)) or len(output) != self.arity:
            raise _not_a_tensor(output, layer_idx, f"a tuple of {self.arity}")
        item = output[self.index]
        if not isinstance(item, torch.Tensor):
            raise _not_a_tensor(item, layer_idx, f"a tensor at index {self.index}")
        return item

    def from_wire(self, tensor: torch.Tensor) -> Any:
        return tuple(tensor if i == self.index else None for i in range(self.arity))
