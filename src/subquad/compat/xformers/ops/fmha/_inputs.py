"""One call of ``memory_efficient_attention``, validated once: xformers' ``Inputs`` rules and messages.

Layouts (the letters of the whole package): ``B`` batch, ``M``/``Mq`` query length, ``Mkv`` key
length, ``G`` head groups, ``H`` heads (per group), ``K`` head dim of q/k, ``Kv`` of v; ``T`` the
packed length of a block-diagonal call (its ``M`` at batch 1).

=========  ====================  ========================  =====================
layout     q / k / v             tensor bias               lse
=========  ====================  ========================  =====================
BMK        ``(B, M, K)``         ``(B, Mq, Mkv)``          ``(B, 1, M)``
BMHK       ``(B, M, H, K)``      ``(B, H, Mq, Mkv)``       ``(B, H, M)``
BMGHK      ``(B, M, G, H, K)``   ``(B, G, H, Mq, Mkv)``    ``(B, G, H, M)``
=========  ====================  ========================  =====================

Block-diagonal biases take batch 1 and give the lse ``(1, [G,] H, T)``. Used by the rest of the
package: :class:`Inputs` (``validate`` returns the bias's reading; ``output_dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from subquad import ArgumentError, ArgumentTypeError

from ._reading import Blocks, Dense, Reading, read_bias

# Bias classes xformers accepts with BMK inputs (its rule compares the exact type).
_BMK_BIASES = ("NoneType", "Tensor", "LowerTriangularMask")


def _shapes(q: Tensor, k: Tensor, v: Tensor) -> str:
    return f"  query.shape: {q.shape}\n  key.shape  : {k.shape}\n  value.shape: {v.shape}"


@dataclass
class Inputs:
    """The arguments of one call, as xformers' ``fmha.Inputs`` holds them."""

    query: Tensor
    key: Tensor
    value: Tensor
    attn_bias: object = None
    p: float = 0.0
    scale: Optional[float] = None
    output_dtype: Optional[torch.dtype] = None
    is_partial: bool = False

    @property
    def layout(self) -> str:
        return {3: "BMK", 4: "BMHK", 5: "BMGHK"}[self.query.dim()]

    def get_output_dtype(self) -> torch.dtype:
        """``output_dtype``, else float32 for a partial call (float64 kept), else the query's dtype."""
        if self.output_dtype is not None:
            return self.output_dtype
        if self.is_partial and self.query.dtype != torch.float64:
            return torch.float32
        return self.query.dtype

    def validate(self) -> Reading:
        """Check the call as xformers does (same order, same messages) and read the bias.

        Raises:
            ValueError (also ``RuntimeError``): xformers' refusals, and inputs that do not match
                what the bias was built for.
            TypeError: ``scale``/``output_dtype``/tensors of the wrong type.
            NotImplementedError: quantized (int32) keys/values; a bias class subquad does not know.
        """
        q, k, v = self.query, self.key, self.value
        for name, t in (("query", q), ("key", k), ("value", v)):
            if not isinstance(t, Tensor):
                raise ArgumentTypeError(f"Expected {name} to be a torch.Tensor, got {type(t).__name__}.")
        if q.dim() not in (3, 4, 5) or any(t.dim() != q.dim() for t in (k, v)):
            raise ArgumentError(f"Query/Key/Value should all have BMGHK, BMHK or BMK shape.\n{_shapes(q, k, v)}")
        if any(t.device != q.device for t in (k, v)):
            raise ArgumentError("Query/Key/Value should all be on the same device")
        if k.dtype == v.dtype == torch.int32:
            raise NotImplementedError(
                "Quantized (int32) key/value are xformers' split-K kernels' format; subquad does not read them."
            )
        if any(t.dtype != q.dtype for t in (k, v)):
            raise ArgumentError(
                "Query/Key/Value should either all have the same dtype, or (in the quantized case) Key/Value should have "
                f"dtype torch.int32\n  query.dtype: {q.dtype}\n  key.dtype  : {k.dtype}\n  value.dtype: {v.dtype}"
            )
        if not q.is_floating_point():
            raise ArgumentTypeError(f"Expected floating-point query/key/value, got {q.dtype}.")
        reading = read_bias(self.attn_bias)
        if q.dim() == 3 and reading.name not in _BMK_BIASES:
            raise ArgumentError(
                f"Please provide inputs in BMHK format rather than BMK when using bias type `{reading.name}`"
            )
        if isinstance(reading, Dense) and reading.tensor is not None:
            self._check_tensor_bias(reading.tensor)
        if isinstance(reading, Blocks) and any(t.shape[0] != 1 for t in (q, k, v)):
            raise ArgumentError(f"Expected batch_size=1 when using block-diagonal bias\n{_shapes(q, k, v)}")
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float)):
            raise ArgumentTypeError(f"Expected p (the dropout probability) to be a float, got {type(self.p).__name__}.")
        if self.p < 0.0 or self.p > 1.0:
            raise ArgumentError(f"Invalid dropout probability: p={self.p}")
        self._check_shapes()
        if self.scale is not None and (isinstance(self.scale, bool) or not isinstance(self.scale, (int, float))):
            raise ArgumentTypeError(f"Expected scale to be None or a float, got {type(self.scale).__name__}.")
        if self.output_dtype is not None and not isinstance(self.output_dtype, torch.dtype):
            raise ArgumentTypeError(f"Expected output_dtype to be None or a torch.dtype, got {self.output_dtype!r}.")
        if isinstance(reading, Blocks):
            self._check_blocks(reading)
        return reading

    def _check_shapes(self) -> None:
        q, k, v = self.query, self.key, self.value
        B, K = q.shape[0], q.shape[-1]
        Mkv, Kv = k.shape[1], v.shape[-1]
        heads = tuple(q.shape[2:-1])  # () / (H,) / (G, H)
        if not (k.shape == (B, Mkv, *heads, K) and v.shape == (B, Mkv, *heads, Kv)):
            raise ArgumentError(
                f"Incompatible shapes for attention inputs:\n{_shapes(q, k, v)}\nHINT: We don't support broadcasting, please "
                "use `expand` yourself before calling `memory_efficient_attention` if you need to"
            )

    def _check_tensor_bias(self, bias: Tensor) -> None:
        q, k = self.query, self.key
        expected: Tuple[int, ...] = (q.shape[0], *q.shape[2:-1], q.shape[1], k.shape[1])
        if tuple(bias.shape) != expected:
            raise ArgumentError(
                f"Invalid shape for attention bias: {bias.shape} (expected {expected})\n{_shapes(q, k, self.value)}"
            )
        if bias.dtype != q.dtype:
            raise ArgumentError(
                f"Expected attn_bias.dtype == query.dtype (an additive bias in the inputs' dtype), got {bias.dtype} and "
                f"{q.dtype}: pass attn_bias.to({q.dtype})."
            )
        if bias.device != q.device:
            raise ArgumentError(f"Expected attn_bias on the device of query ({q.device}), got {bias.device}.")

    def _check_blocks(self, blocks: Blocks) -> None:
        q, k = self.query, self.key
        if q.shape[1] != blocks.q_starts[-1]:
            raise ArgumentError(
                f"attn_bias ({blocks.name}) describes {blocks.q_starts[-1]} queries in {len(blocks.q_starts) - 1} blocks, "
                f"but query.shape[1] = {q.shape[1]} (query.shape: {q.shape})."
            )
        if not blocks.paged:
            if k.shape[1] != blocks.k_total:
                raise ArgumentError(
                    f"attn_bias ({blocks.name}) was built for {blocks.k_total} keys, but key.shape[1] = {k.shape[1]} "
                    f"(key.shape: {k.shape})."
                )
            return
        assert blocks.block_tables is not None and blocks.page_size is not None
        ps = blocks.page_size
        if k.shape[1] % ps:
            raise ArgumentError(
                f"Expected key.shape[1] ({k.shape[1]}) to be whole pages of page_size={ps} ({blocks.name})."
            )
        if blocks.block_tables.numel():
            lo, hi = int(blocks.block_tables.min()), int(blocks.block_tables.max())
            if lo < 0 or hi >= k.shape[1] // ps:
                raise ArgumentError(
                    f"attn_bias.block_tables names pages {lo}..{hi}, but key holds {k.shape[1] // ps} pages of "
                    f"{ps} (key.shape: {k.shape})."
                )
