"""The ``sdpa`` backend: ``torch.nn.functional.scaled_dot_product_attention`` on the whole input.

Restricted to torch's fused kernels (flash, efficient, cuDNN) so that it can never fall back to
the math path, which materializes ``B·H·Lq·Lk`` scores.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.torch_version import TorchVersion

from .._inputs import Inputs
from . import mps_sdpa
from .base import Backend, Options, _bh
from .fused import FusedCPU

# Torch's own SDPA: its builtin, never what ``F.scaled_dot_product_attention`` happens to be when
# subquad is imported (a profiling wrapper, another library's patch, subquad.patch_sdpa itself).
TORCH_SDPA = (
    getattr(getattr(torch._C, "_nn", None), "scaled_dot_product_attention", None) or F.scaled_dot_product_attention
)

MiB = 1 << 20


_ZERO_ROWS_FROM = {"cuda": (2, 5)}
"""The torch release from which SDPA returns 0, not NaN, for a row that sees no key, per device
(CUDA's fused kernels: pytorch#133882; MPS: :data:`mps_sdpa.DEFECTS`). The CPU kernel always did."""


@functools.lru_cache(maxsize=None)
def _nan_rows(version: str, device_type: str) -> bool:
    fixed = _ZERO_ROWS_FROM.get(device_type)
    return fixed is not None and TorchVersion(version) < TorchVersion(".".join(map(str, fixed)))


def sdpa_nan_for_unseen_rows(device_type: str) -> bool:
    """Whether this torch's SDPA on ``device_type`` returns NaN for a fully masked row."""
    return _nan_rows(str(torch.__version__), device_type)


class Sdpa(Backend):
    """``torch.nn.functional.scaled_dot_product_attention`` on the whole input, fused kernels only.

    The math fallback (which materializes ``B·H·Lq·Lk`` scores) is never allowed to run here.
    """

    name = "sdpa"
    tiled = False
    devices = ("cuda", "cpu", "mps")

    def not_supported_reasons(self, inp: Inputs, opts: Options) -> List[str]:
        reasons = super().not_supported_reasons(inp, opts)
        if opts.packed:
            reasons.append("packed sequences run in tiles, one sequence at a time")
        if inp.has_callbacks:
            reasons.append("score_mod/mask_mod are not supported by torch's SDPA")
        if opts.return_lse:
            reasons.append("return_lse=True: torch's SDPA does not return the log-sum-exp")
        if opts.chunk_size is not None:
            reasons.append("chunk_size asks for tiles; SDPA runs the whole input")
        if inp.attn_mask is not None and inp.attn_mask.requires_grad and torch.is_grad_enabled():
            reasons.append("attn_mask requires grad: SDPA would take its math path (Lq x Lk memory)")
        if inp.is_causal and inp.causal_offset != 0:
            reasons.append("bottom-right causal: torch's SDPA takes it only as a CausalBias, which may materialize it")
        if inp.is_causal and not inp.positive_scale:
            reasons.append(
                f"is_causal with scale={inp.scale:g}, not positive in {inp.stats_dtype}: torch's fused kernels return NaN"
            )
        if inp.n_groups > 1 or inp.kv_broadcast or inp.query.shape[0] != inp.B:
            reasons.append("batch dims broadcast between query, key and value: SDPA may expand them in memory")
        if inp.device_type == "cpu":
            if inp.Ev != inp.E:
                reasons.append(f"on CPU SDPA's fused kernel needs Ev == E, got Ev={inp.Ev}, E={inp.E}")
            if inp.dropout_p > 0:
                reasons.append("on CPU SDPA's fused kernel does not support dropout")
            if inp.G > 1:
                reasons.append("on CPU SDPA takes its math path for grouped-query attention")
        if inp.device_type == "cuda" and inp.dtype == torch.float64:
            reasons.append("no fused CUDA kernel takes float64")
        if inp.attn_mask is not None and sdpa_nan_for_unseen_rows(inp.device_type):
            reasons.append(
                f"torch {torch.__version__}'s SDPA on {inp.device_type} returns NaN for rows the mask hides entirely "
                f"(fixed in torch {'.'.join(map(str, _ZERO_ROWS_FROM[inp.device_type]))}); the tiles return 0 there"
            )
        if inp.device_type == "mps":
            refusal = mps_sdpa.route(inp).refusal
            if refusal is not None:
                reasons.append(refusal)
        return reasons

    def notes(self, inp: Inputs) -> List[str]:
        if inp.device_type != "mps":
            return super().notes(inp)
        r = mps_sdpa.route(inp)
        return [f"torch {r.version} on MPS runs it in {r.path.what}"] + r.notes()

    def forward_bytes(self, inp: Inputs, qc: int, kc: int, need_lse: bool) -> int:
        bh = _bh(inp)
        n = bh * inp.Lq * 4 * 2  # the kernel's lse / softmax statistics
        if inp.attn_mask is not None:
            # Bool masks become float masks; the efficient kernel pads Lk to a multiple of 16.
            n += inp.mask_tile_elements(inp.Lq, inp.Lk + 16) * inp.itemsize * 2
        if inp.device_type == "mps":
            # What torch's path for the call holds (the scores on MPSGraph and the math path, none
            # in the prefill kernels), and the detours' copies.
            r = mps_sdpa.route(inp)
            n += mps_sdpa.path_bytes(inp, r.path) + mps_sdpa.detour_bytes(inp, r)
        if inp.device_type == "cpu":
            n += FusedCPU()._kernel_bytes(inp, inp.Lq, inp.Lk)
        return n + 1 * MiB

    def backward_bytes(self, inp: Inputs, qc: int, kc: int, opts: Options) -> int:
        bh = _bh(inp)
        n = self.forward_bytes(inp, qc, kc, True)
        n += (bh * inp.Lq * inp.E + inp.B * inp.Hk * inp.Lk * (inp.E + inp.Ev)) * 4  # float32 accumulators
        if inp.device_type == "mps":
            n += bh * inp.Lq * inp.Lk * 4 * 2
        return n

    def run_whole(self, inp: Inputs, need_lse: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        """``(out (B, Hq, Lq, Ev), None)``: torch's SDPA on the call, fused kernels only (no lse)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kwargs: Dict[str, Any] = dict(
            attn_mask=inp.attn_mask, dropout_p=inp.dropout_p, is_causal=inp.is_causal, scale=inp.scale
        )
        if inp.G > 1:
            kwargs["enable_gqa"] = True
        if inp.device_type == "mps":
            r = mps_sdpa.route(inp)
            if r.refusal is not None:  # planned on another release, or the fast path at a new length
                raise RuntimeError(f"no exact MPS kernel for this call: {r.refusal}")
            a = mps_sdpa.apply(inp, r)
            kwargs.update(attn_mask=a.attn_mask, is_causal=a.is_causal, scale=a.scale)
            return TORCH_SDPA(a.query, a.key, a.value, **kwargs), None
        if inp.device_type == "cuda" and _default_is_fused(inp.query, inp.key, inp.value, kwargs):
            return TORCH_SDPA(inp.query, inp.key, inp.value, **kwargs), None
        fused = [
            getattr(SDPBackend, n)
            for n in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
            if hasattr(SDPBackend, n)
        ]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SDPA warns about every kernel it declines
            with sdpa_kernel(fused):
                return TORCH_SDPA(inp.query, inp.key, inp.value, **kwargs), None


@functools.lru_cache(maxsize=None)
def _fused_choices() -> frozenset:
    """The values of torch's fused SDPA kernels in its ``SDPBackend`` enum."""
    from torch.nn.attention import SDPBackend

    names = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
    return frozenset(int(getattr(SDPBackend, n)) for n in names if hasattr(SDPBackend, n))


def _default_is_fused(q: Tensor, k: Tensor, v: Tensor, kwargs: Dict[str, Any]) -> bool:
    """Whether torch's own choice for this call is a fused kernel (``torch._fused_sdp_choice``, what
    SDPA itself asks): then the call needs neither ``sdpa_kernel`` nor a warnings filter, which
    cost more than SDPA itself on small calls (docs/benchmarks/gpu.md). Where torch would
    take its math fallback (or the question fails), ``False``: the caller restricts the kernels."""
    choose = getattr(torch, "_fused_sdp_choice", None)
    if choose is None:
        return False
    try:
        return int(choose(q, k, v, **kwargs)) in _fused_choices()
    except Exception:  # an argument this torch's chooser does not take: ask the long way
        return False
