"""A validated call run on subquad: whole-grid biases through ``subquad.attention``, block-diagonal
ones through ``subquad.varlen_attention``; nothing ``Mq x Mkv`` is ever built.

- BMK / BMHK / BMGHK are views into subquad's ``(..., H, L, E)`` layout (``(B, [G,] H, M, K)``);
  heads that xformers' callers give expanded (``key.stride(-2) == 0``, its GQA convention) run as
  grouped-query attention on one kv head instead of ``H`` copies (when no gradient is needed for
  them).
- Block-diagonal keys that follow one another (plain, *PaddedKeys*, tidy *GappyKeys*) are one
  packed call (``cu_seqlens_k`` + ``seqused_k``); key ranges that overlap or go backwards split
  into runs that do follow one another, one packed call each (views, no copy); paged keys are
  gathered one sequence at a time (a copy of that sequence's pages only).

Used by the rest of the package: :func:`forward`, :func:`gradients`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

import subquad
from subquad import mods

from ._inputs import Inputs
from ._reading import Band, Blocks, Dense, Reading

Result = Tuple[Tensor, Optional[Tensor]]


def forward(inp: Inputs, reading: Reading, *, return_lse: bool) -> Result:
    """``out`` in the inputs' layout (contiguous, ``inp.get_output_dtype()``), ``lse`` in xformers' layout (or None)."""
    out, lse = _blocks(inp, reading, return_lse) if isinstance(reading, Blocks) else _dense(inp, reading, return_lse)
    out = out.to(inp.get_output_dtype())
    return (out if out.is_contiguous() else out.contiguous()), lse


def gradients(inp: Inputs, reading: Reading, grad: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of ``forward`` for the output gradient ``grad``, by recomputing the forward.

    A tensor bias is held constant (xformers' backward returns no bias gradient).
    """
    if isinstance(reading, Dense) and reading.tensor is not None:
        reading = dataclasses.replace(reading, tensor=reading.tensor.detach())
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_(True) for t in (inp.query, inp.key, inp.value))
        call = dataclasses.replace(inp, query=q, key=k, value=v, output_dtype=None, is_partial=False)
        out, _ = forward(call, reading, return_lse=False)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype).reshape(out.shape))
    return dq, dk, dv


def _shared_heads(key: Tensor, value: Tensor) -> bool:
    """Heads given expanded (stride 0 along H): run them as one kv head, unless they need gradients
    (autograd keeps a gradient per expanded head, which one shared head cannot give back)."""
    return (
        key.dim() >= 4
        and key.shape[-2] > 1
        and key.stride(-2) == 0
        and value.stride(-2) == 0
        and not (key.requires_grad or value.requires_grad)
    )


# ----------------------------------------------------------------------------- whole-grid biases
def _to_heads_first(x: Tensor) -> Tensor:
    """BMK stays ``(B, M, K)`` (B plays the heads); BMHK -> ``(B, H, M, K)``; BMGHK -> ``(B, G, H, M, K)``."""
    return x if x.dim() == 3 else x.movedim(1, -2)


def _dense_mask(band: Band, q_len: int, k_len: int, has_tensor: bool) -> Dict[str, Any]:
    if band.is_full:
        return {}
    if band == Band(right=0):
        return {"mask_mod": mods.causal()} if has_tensor else {"is_causal": True}
    if band == Band(bottom_right=True, right=0):
        return {"mask_mod": mods.causal_lower_right(q_len, k_len)}
    return {"mask_mod": mods.local_window(band.left, band.right, offset=band.offset(q_len, k_len))}


def _dense(inp: Inputs, reading: Dense, return_lse: bool) -> Result:
    q, k, v = (_to_heads_first(t) for t in (inp.query, inp.key, inp.value))
    gqa = _shared_heads(inp.key, inp.value)
    if gqa:
        k, v = k.narrow(-3, 0, 1), v.narrow(-3, 0, 1)
    result = subquad.attention(
        q,
        k,
        v,
        attn_mask=reading.tensor,
        scale=inp.scale,
        enable_gqa=gqa,
        dropout_p=inp.p,
        return_lse=return_lse,
        **_dense_mask(reading.band, inp.query.shape[1], inp.key.shape[1], reading.tensor is not None),
    )
    out, lse = result if isinstance(result, tuple) else (result, None)
    out = out if out.dim() == 3 else out.movedim(-2, 1)
    if lse is not None and lse.dim() == 2:  # BMK: xformers gives its lse a head axis of 1
        lse = lse.unsqueeze(1)
    return out, lse


# ----------------------------------------------------------------------------- block-diagonal biases
def _varlen_mask(band: Band) -> Dict[str, Any]:
    window = None
    if band.left is not None or (band.right is not None and band.right > 0):
        window = (band.left, None if band.is_causal else band.right)
    return {
        "is_causal": band.is_causal,
        "window": window,
        "alignment": "bottom_right" if band.bottom_right else "top_left",
    }


def _packed(x: Tensor) -> Tensor:
    """``(1, T, [G,] H, K)`` -> ``(T, [G*]H, K)``."""
    return x[0] if x.dim() == 4 else x[0].flatten(1, 2)


def _blocks(inp: Inputs, blocks: Blocks, return_lse: bool) -> Result:
    q = _packed(inp.query)
    gqa = _shared_heads(inp.key, inp.value)
    if gqa:  # (1, T, G, H, K) with H expanded -> (T, G, K); BMHK with H expanded -> (T, 1, K)
        k, v = (t[0].select(-2, 0) if t.dim() == 5 else t[0].narrow(-2, 0, 1) for t in (inp.key, inp.value))
    else:
        k, v = _packed(inp.key), _packed(inp.value)
    options: Dict[str, Any] = dict(
        scale=inp.scale, enable_gqa=gqa, dropout_p=inp.p, return_lse=True, **_varlen_mask(blocks.band)
    )
    parts = _paged_parts(q, k, v, blocks, options) if blocks.paged else _run_parts(q, k, v, blocks, options)
    T, Hq, Ev = q.shape[0], q.shape[1], v.shape[-1]
    if parts:
        out = torch.cat([o for o, _ in parts]) if len(parts) > 1 else parts[0][0]
        lse = torch.cat([s for _, s in parts]) if len(parts) > 1 else parts[0][1]
    else:  # no sequence at all: T == 0
        out = q.new_zeros((T, Hq, Ev))
        lse = torch.full((T, Hq), float("-inf"), device=q.device)
    out = out.unsqueeze(0)
    lse_heads = lse.t().unsqueeze(0)  # (1, Hq, T)
    if inp.query.dim() == 5:
        G, H = inp.query.shape[2:4]
        out, lse_heads = out.unflatten(2, (G, H)), lse_heads.unflatten(1, (G, H))
    return out, (lse_heads if return_lse else None)


def _runs(blocks: Blocks) -> List[Tuple[int, int]]:
    """Sequences ``[s0, s1)`` whose key ranges follow one another (each starts at or after the last's end)."""
    runs: List[Tuple[int, int]] = []
    first, end = 0, 0
    for s, (a, e) in enumerate(blocks.keys):
        if s > first and a < end:
            runs.append((first, s))
            first = s
        end = e
    if blocks.keys:
        runs.append((first, len(blocks.keys)))
    return runs


def _run_parts(q: Tensor, k: Tensor, v: Tensor, blocks: Blocks, options: Dict[str, Any]) -> List[Tuple[Tensor, Tensor]]:
    parts = []
    for s0, s1 in _runs(blocks):
        qa, qb = blocks.q_starts[s0], blocks.q_starts[s1]
        ranges = blocks.keys[s0:s1]
        ka, kb = ranges[0][0], ranges[-1][1]
        cu_k = [a - ka for a, _ in ranges] + [kb - ka]
        used = [e - a for a, e in ranges]
        tidy = all(n == cu_k[i + 1] - cu_k[i] for i, n in enumerate(used))
        result = subquad.varlen_attention(
            q[qa:qb],
            k[ka:kb],
            v[ka:kb],
            [x - qa for x in blocks.q_starts[s0 : s1 + 1]],  # type: ignore[arg-type]  # lists are taken too
            cu_k,  # type: ignore[arg-type]
            seqused_k=None if tidy else torch.tensor(used, dtype=torch.int32),
            **options,
        )
        assert isinstance(result, tuple)  # options: return_lse=True
        parts.append(result)
    return parts


def _paged_parts(
    q: Tensor, k: Tensor, v: Tensor, blocks: Blocks, options: Dict[str, Any]
) -> List[Tuple[Tensor, Tensor]]:
    assert blocks.block_tables is not None and blocks.page_size is not None
    ps = blocks.page_size
    pages_k, pages_v = k.unflatten(0, (-1, ps)), v.unflatten(0, (-1, ps))  # (num_pages, ps, heads, dim)
    tables = blocks.block_tables.to(device=q.device, dtype=torch.long)
    parts = []
    for s, (a, e) in enumerate(blocks.keys):
        qa, qb = blocks.q_starts[s], blocks.q_starts[s + 1]
        first, last = a // ps, -(-e // ps)
        pages = tables[s, first:last]
        keys, values = (
            p.index_select(0, pages).flatten(0, 1)[a - first * ps : e - first * ps] for p in (pages_k, pages_v)
        )
        result = subquad.varlen_attention(
            q[qa:qb],
            keys,
            values,
            [0, qb - qa],  # type: ignore[arg-type]  # lists are taken too
            [0, e - a],  # type: ignore[arg-type]
            **options,
        )
        assert isinstance(result, tuple)  # options: return_lse=True
        parts.append(result)
    return parts
