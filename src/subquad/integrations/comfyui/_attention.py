"""ComfyUI's attention signatures over ``subquad.sdpa``, and where their memory budget comes from.

Nothing here imports ComfyUI: these run anywhere torch does. The rest of the package may use
:func:`attention`, :func:`vae_attention`, :func:`call_budget`,
:func:`set_memory_budget` and the callables ComfyUI's hooks take
(:class:`Override`, :class:`Replace`, :class:`VaeAttention`).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor

import subquad
from subquad import ArgumentError

from ..._for_wings import Budget, parse_budget
from .._host_budget import env_budget

_ATTENTION = "comfy.ldm.modules.attention"  # = _hooks.ATTENTION (_hooks imports this module)
_SETTING: List[Budget] = []  # [budget] once set_memory_budget() was given one


def set_memory_budget(memory_budget: Budget) -> None:
    """The budget of every call whose node gave none (and of default mode); ``None``: unset it,
    so ``SUBQUAD_MEMORY_BUDGET`` or subquad's default applies again.

    Raises:
        ValueError: a budget that does not parse.
    """
    _SETTING.clear()
    if memory_budget is not None:
        parse_budget(memory_budget)
        _SETTING.append(memory_budget)


def call_budget(memory_budget: Budget) -> Budget:
    """The budget of one call: the given one, else :func:`set_memory_budget`'s, else ``SUBQUAD_MEMORY_BUDGET``."""
    if memory_budget is not None:
        return memory_budget
    if _SETTING:
        return _SETTING[0]
    return env_budget()


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    heads: int,
    mask: Optional[Tensor] = None,
    attn_precision: Optional[torch.dtype] = None,
    skip_reshape: bool = False,
    skip_output_reshape: bool = False,
    **kwargs: Any,
) -> Tensor:
    r"""ComfyUI's attention function (``optimized_attention``'s signature), computed by ``subquad.sdpa``.

    Layouts (``B`` batch, ``H = heads``, ``L`` tokens, ``D``/``Dv`` head dims):

    - ``q [B, Lq, H*D]``, ``k [B, Lk, H*D]``, ``v [B, Lk, H*Dv]``; with ``skip_reshape=True``
      ``q [B, H, Lq, D]``, ``k [B, H, Lk, D]``, ``v [B, H, Lk, Dv]``;
    - output ``[B, Lq, H*Dv]``, or ``[B, H, Lq, Dv]`` with ``skip_output_reshape=True``; the dtype of ``q``.

    ``mask`` as ComfyUI's PyTorch attention reads it: ``[Lq, Lk]``, ``[B, Lq, Lk]`` or
    ``[B, H, Lq, Lk]`` (any dim may be 1), bool (True = attend) or additive. Equal to::

        q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k, v))  # unless skip_reshape
        mask = mask[None, None] if mask.ndim == 2 else mask[:, None] if mask.ndim == 3 else mask
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(1, 2).flatten(2)                      # unless skip_output_reshape

    with the scores, softmax and sums in float32 for half-precision inputs, in tiles that keep the
    memory budget. ``attn_precision`` (after ComfyUI's ``--force-upcast-attention`` /
    ``--dont-upcast-attention``) of float32 is therefore met; on MPS, where torch's MPSGraph path
    rounds the scores to the inputs' dtype, it casts the inputs to float32; a wider one (float64)
    casts the inputs. A row whose keys are all masked gives 0.

    Keyword arguments: ``memory_budget`` (else :func:`call_budget`'s order); every other one ComfyUI
    passes (``transformer_options``, ...) is accepted and ignored.

    Raises:
        ValueError: shapes that do not fit the layout (naming them).
        MemoryBudgetError: the budget cannot hold even the smallest tiles.
    """
    budget = call_budget(kwargs.get("memory_budget"))
    dtype = q.dtype
    if skip_reshape:
        if q.ndim != 4:
            raise ArgumentError(f"Expected q of shape [B, heads, L, D] with skip_reshape=True, got {tuple(q.shape)}.")
        b = q.shape[0]
    else:
        if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
            raise ArgumentError(
                f"Expected q, k, v of shape [B, L, heads*D] (or [B, heads, L, D] with skip_reshape=True), "
                f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}."
            )
        if heads <= 0 or any(t.shape[-1] % heads for t in (q, k, v)):
            raise ArgumentError(
                f"Expected the last dims of q, k, v to be multiples of heads={heads}, "
                f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}."
            )
        b = q.shape[0]
        q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k, v))

    if mask is not None:
        if mask.ndim == 2:
            mask = mask[None, None]
        elif mask.ndim == 3:
            mask = mask[:, None]

    precision = _precision(attn_precision, dtype)
    if precision is not None and precision.is_floating_point and precision.itemsize > max(dtype.itemsize, 4):
        q, k, v = q.to(precision), k.to(precision), v.to(precision)
    elif precision == torch.float32 and dtype in (torch.float16, torch.bfloat16) and _on_mps(q):
        # torch's MPSGraph path rounds q·kᵀ to the inputs' dtype (float16 overflows past 65504):
        # the upcast ComfyUI asked for is kept by running the call in float32
        q, k, v = q.float(), k.float(), v.float()
    out = subquad.sdpa(q, k, v, attn_mask=mask, memory_budget=budget).to(dtype)
    if skip_output_reshape:
        return out
    return out.transpose(1, 2).reshape(b, -1, heads * out.shape[-1])


def _on_mps(t: Tensor) -> bool:
    return t.device.type == "mps"


def _precision(attn_precision: Optional[torch.dtype], dtype: torch.dtype) -> Optional[torch.dtype]:
    """``attn_precision`` as ComfyUI resolves it (its upcast flags), when ComfyUI is running."""
    host = sys.modules.get(_ATTENTION)
    resolve = getattr(host, "get_attn_precision", None)
    if resolve is None:
        return attn_precision
    try:
        resolved: Optional[torch.dtype] = resolve(attn_precision, dtype)
    except TypeError:  # a ComfyUI whose helper takes other arguments
        return attn_precision
    return resolved


def vae_attention(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
    """The attention of ComfyUI's VAE blocks (``AttnBlock.optimized_attention``), computed by ``subquad.sdpa``.

    ``q``, ``k``, ``v`` are ``[B, C, *spatial]`` (``[B, C, H, W]``, or ``[B, C, T, H, W]`` for video
    VAEs): one head of ``C`` channels over ``H*W`` tokens; the output has the same shape. Equal to::

        q, k, v = (t.reshape(B, 1, C, -1).transpose(2, 3) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(2, 3).reshape(shape)

    Keyword arguments: ``memory_budget``. At 2048 px (a 256x256 latent) the scores alone would be
    16 GiB of float32; the tiles keep the call within its budget.
    """
    shape = q.shape
    b, c = shape[0], shape[1]
    q, k, v = (t.reshape(b, 1, c, -1).transpose(2, 3) for t in (q, k, v))
    out = subquad.sdpa(q, k, v, memory_budget=call_budget(kwargs.get("memory_budget")))
    return out.transpose(2, 3).reshape(shape)


class Override:
    """``transformer_options["optimized_attention_override"]``: ComfyUI's ``wrap_attn`` calls it as
    ``override(func, *args, **kwargs)`` in place of the attention function ``func`` it chose."""

    def __init__(self, memory_budget: Budget) -> None:
        self.memory_budget = memory_budget

    def __call__(self, func: Callable[..., Tensor], *args: Any, **kwargs: Any) -> Tensor:
        kwargs["memory_budget"] = self.memory_budget
        return attention(*args, **kwargs)

    def __repr__(self) -> str:
        return f"subquad attention (memory_budget={self.memory_budget!r})"


class Replace:
    """An attn1/attn2 replace patch of ComfyUI's ``BasicTransformerBlock``: ``(q, k, v, extra_options)``,
    q/k/v already projected (``[B, L, heads*D]``)."""

    def __init__(self, memory_budget: Budget) -> None:
        self.memory_budget = memory_budget

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, extra_options: Dict[str, Any]) -> Tensor:
        return attention(
            q,
            k,
            v,
            extra_options["n_heads"],
            attn_precision=extra_options.get("attn_precision"),
            memory_budget=self.memory_budget,
        )


class VaeAttention:
    """What a VAE block's ``optimized_attention`` becomes: :func:`vae_attention` with a budget."""

    def __init__(self, memory_budget: Budget) -> None:
        self.memory_budget = memory_budget

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return vae_attention(q, k, v, memory_budget=self.memory_budget)

    def __repr__(self) -> str:
        return f"subquad VAE attention (memory_budget={self.memory_budget!r})"
