"""subquad.compat.flash_attn: flash-attn 2.8's API over subquad, checked as flash-attn checks itself.

The references are written here from the definitions of flash-attn's ``tests/test_flash_attn.py``
(``attention_ref`` with query/key padding masks, local windows, ALiBi from slopes, softcap,
``key_leftpad``; ``generate_random_padding_mask`` in its ``random``, ``full`` and ``third``
modes; its kvcache reference with paging and rotary). Its criterion: the error against the
float64 golden is at most 2x (gradients 3x) that of a same-dtype plain-PyTorch implementation
that reorders the scaling, plus a small floor (``conftest.assert_close_to_golden``). Cases sample
MHA/MQA/GQA x causal x local x ALiBi x softcap on flash-attn's odd sizes; everything runs on CPU.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import subprocess
import sys

import pytest
import torch
from torch import Tensor

import subquad
from conftest import assert_close_to_golden
from subquad.compat import flash_attn as fa
from subquad.compat.flash_attn.bert_padding import (
    index_first_axis,
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)
from subquad.compat.flash_attn.layers.rotary import apply_rotary_emb

f64 = torch.float64


# ----------------------------------------------------------------------------- references
def padding_mask(max_seqlen: int, batch: int, mode: str, gen: torch.Generator, empty: int = 0) -> Tensor:
    """flash-attn's ``generate_random_padding_mask``; ``"empty"`` is ``"third"`` with sequence ``empty`` of no tokens."""
    if mode == "full":
        lengths = torch.full((batch, 1), max_seqlen)
    elif mode == "random":
        lengths = torch.randint(max(1, max_seqlen - 20), max_seqlen + 1, (batch, 1), generator=gen)
    elif mode in ("third", "empty"):
        lengths = torch.randint(max_seqlen // 3, max_seqlen + 1, (batch, 1), generator=gen)
        if mode == "empty":
            lengths[empty] = 0
    else:
        raise AssertionError(mode)
    return torch.arange(max_seqlen).expand(batch, max_seqlen) < lengths


def attention_ref(
    q,
    k,
    v,
    query_padding_mask=None,
    key_padding_mask=None,
    alibi_slopes=None,
    dropout_mask=None,
    dropout_p=0.0,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    upcast=True,
    reorder_ops=False,
    key_leftpad=None,
):
    """flash-attn's test reference, materialized: ``out (B, Sq, H, Dv)`` and ``lse (B, H, Sq)``.

    ``upcast``: compute in float64 (the golden; flash-attn's tests use float32), else in the
    inputs' dtype with the scaling on k (``reorder_ops``: the plain-PyTorch error to beat). Keys
    are counted from ``key_leftpad``; each row's diagonal is ``i + sk - sq`` with the batch's
    actual lengths. ALiBi is ``slope * j`` with the causal kernel (flash-attn's, equal after the
    softmax and giving its lse), ``-slope * |diag - j|`` otherwise. Rows that see no key: 0, lse +inf.
    """
    dtype = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    B, Sq, H, D = q.shape
    Sk = k.shape[1]
    k = k.repeat_interleave(H // k.shape[2], dim=2)
    v = v.repeat_interleave(H // v.shape[2], dim=2)
    scale = D**-0.5
    s = torch.einsum("bqhd,bkhd->bhqk", q, k * scale) if reorder_ops else torch.einsum("bqhd,bkhd->bhqk", q * scale, k)
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    i = torch.arange(Sq).view(1, 1, Sq, 1)
    j = torch.arange(Sk).view(1, 1, 1, Sk)
    if key_leftpad is not None:
        j = j - key_leftpad.long().view(B, 1, 1, 1)
    sk = Sk if key_padding_mask is None else key_padding_mask.sum(-1).view(B, 1, 1, 1)
    sq = Sq if query_padding_mask is None else query_padding_mask.sum(-1).view(B, 1, 1, 1)
    diag = i + sk - sq
    keep = torch.ones(B, 1, Sq, Sk, dtype=torch.bool)
    if key_padding_mask is not None:
        keep = keep & key_padding_mask.view(B, 1, 1, Sk)
    left, right = (int(x) for x in window_size)
    if causal:
        right = 0
    if right >= 0:
        keep = keep & (j <= diag + right)
    if left >= 0:
        keep = keep & (j >= diag - left)
    if alibi_slopes is not None:
        slopes = alibi_slopes.expand(B, H).reshape(B, H, 1, 1)
        slopes = slopes.double() if upcast else slopes
        causal_kernel = left < 0 and right == 0
        s = s + (slopes * j if causal_kernel else -slopes * (diag - j).abs())
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    lse = torch.where(torch.isneginf(lse), math.inf, lse)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0).to(v.dtype)
    if query_padding_mask is not None:
        p = p.masked_fill(~query_padding_mask.view(B, 1, Sq, 1), 0.0)
    if dropout_mask is not None:
        p = p.masked_fill(~dropout_mask, 0.0) / (1 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    if query_padding_mask is not None:
        out = out.masked_fill(~query_padding_mask.view(B, Sq, 1, 1), 0.0)
    return out.to(dtype), lse


def rotary_ref(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """flash-attn's ``apply_rotary_emb_torch`` (``rotate_half``) at ``positions`` (x's leading dims)."""
    rd = 2 * cos.shape[-1]
    c, s = cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)
    if interleaved:
        c, s = c.repeat_interleave(2, dim=-1), s.repeat_interleave(2, dim=-1)
        x1, x2 = x[..., 0:rd:2], x[..., 1:rd:2]
        half = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        c, s = torch.cat((c, c), dim=-1), torch.cat((s, s), dim=-1)
        x1, x2 = x[..., : rd // 2], x[..., rd // 2 : rd]
        half = torch.cat((-x2, x1), dim=-1)
    wide = torch.promote_types(x.dtype, torch.float32)
    rotated = x[..., :rd].to(wide) * c.to(wide) + half.to(wide) * s.to(wide)
    return torch.cat((rotated.to(x.dtype), x[..., rd:]), dim=-1)


def three(q, k, v, dtype):
    """The float64 golden inputs and the tested/naive inputs (leaves that require grad)."""
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    return leaves


def grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g, allow_unused=True)


def check_like_flash(out, out_ref, out_pt, name="output", fudge=2.0, floor=None):
    assert_close_to_golden(out, out_ref, out_pt, fudge=fudge, floor=floor, name=name)


# ----------------------------------------------------------------------------- batches
# causal, local, alibi, softcap
_AXES = list(itertools.product([False, True], [False, True], [False, True], [0.0, 50.0]))
_MHA = ["mha", "mqa", "gqa"]
_SIZES = [(113, 203), (108, 256), (203, 113), (1, 147), (128, 217)]
_DIMS = [59, 111, 256, 64]


def _dense_cases():
    rng = random.Random(0)
    cases = []
    for n, (causal, local, alibi, softcap) in enumerate(rng.sample(_AXES, 10)):
        mha = _MHA[n % 3]
        dtype = [torch.float32, torch.float32, torch.bfloat16, f64][n % 4]
        d = _DIMS[n % len(_DIMS)]
        sq, sk = _SIZES[n % len(_SIZES)]
        cases.append(
            pytest.param(
                mha,
                causal,
                local,
                alibi,
                softcap,
                d,
                sq,
                sk,
                dtype,
                n % 3 == 0,
                id=f"{mha}-{'causal' if causal else 'full'}{'-local' if local else ''}"
                f"{'-alibi' if alibi else ''}{'-softcap' if softcap else ''}-d{d}-{sq}x{sk}-"
                f"{str(dtype)[6:]}{'-kvpacked' if n % 3 == 0 else ''}",
            )
        )
    # flash-attn's long odd sizes, few heads: one each way.
    cases.append(
        pytest.param(
            "gqa",
            True,
            False,
            True,
            0.0,
            59,
            1023,
            1024,
            torch.float32,
            False,
            id="gqa-causal-alibi-d59-1023x1024-float32",
        )
    )
    cases.append(
        pytest.param(
            "mqa",
            False,
            True,
            False,
            50.0,
            111,
            1024,
            1023,
            torch.float32,
            True,
            id="mqa-local-softcap-d111-1024x1023-float32-kvpacked",
        )
    )
    return cases


def _heads(mha, big):
    nheads = 2 if big else 4
    return nheads, {"mha": nheads, "mqa": 1, "gqa": 2}[mha]


@pytest.mark.parametrize("mha,causal,local,alibi,softcap,d,seqlen_q,seqlen_k,dtype,kvpacked", _dense_cases())
def test_flash_attn_output(mha, causal, local, alibi, softcap, d, seqlen_q, seqlen_k, dtype, kvpacked):
    gen = torch.Generator().manual_seed(seqlen_q * 7 + d)
    big = seqlen_q > 1000
    batch = 1 if big else 2
    nheads, nheads_k = _heads(mha, big)
    window = (-1, -1) if not local else tuple(torch.randint(0, seqlen_k, (2,), generator=gen).tolist())
    q0 = torch.randn(batch, seqlen_q, nheads, d, generator=gen, dtype=f64) * (softcap / 8 if softcap else 1.0)
    k0 = torch.randn(batch, seqlen_k, nheads_k, d, generator=gen, dtype=f64)
    v0 = torch.randn(batch, seqlen_k, nheads_k, d, generator=gen, dtype=f64)
    slopes = torch.rand(batch, nheads, generator=gen) * 0.3 if alibi else None
    q, k, v = three(q0, k0, v0, dtype)
    q_ref, k_ref, v_ref = three(q0, k0, v0, f64)
    opts = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    if kvpacked:
        kv = torch.stack([k, v], dim=2).detach().requires_grad_()
        out, lse, probs = fa.flash_attn_kvpacked_func(q, kv, return_attn_probs=True, **opts)
    else:
        out, lse, probs = fa.flash_attn_func(q, k, v, 0.0, None, return_attn_probs=True, **opts)
    out_ref, lse_ref = attention_ref(q_ref, k_ref, v_ref, **opts)
    out_pt, lse_pt = attention_ref(q, k, v, upcast=False, reorder_ops=True, **opts)

    assert out.shape == (batch, seqlen_q, nheads, d) and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (batch, nheads, seqlen_q) and lse.dtype == (f64 if dtype == f64 else torch.float32)
    assert probs.shape == (0,) and probs.dtype == dtype
    floor = 1e-10 if dtype == f64 else None
    check_like_flash(out, out_ref, None if dtype == f64 else out_pt, floor=floor)
    check_like_flash(
        lse, lse_ref, None if dtype == f64 else lse_pt.float(), name="lse", floor=floor if dtype == f64 else 1e-5
    )

    g = torch.randn(out.shape, generator=gen, dtype=f64)
    leaves = (q, kv) if kvpacked else (q, k, v)
    got = grads(out, leaves, g.to(dtype))
    if kvpacked:
        got = (got[0], *got[1].unbind(2))
    want = grads(out_ref, (q_ref, k_ref, v_ref), g)
    naive = grads(out_pt, (q, k, v), g.to(dtype))
    for name, a, b, c in zip(("dq", "dk", "dv"), got, want, naive):
        assert_close_to_golden(a, b, None if dtype == f64 else c, fudge=3.0, floor=floor, name=name)


def test_causal_is_bottom_right_and_empty_rows_give_zero_and_lse_inf():
    """flash-attn's drawing: Sq=5, Sk=2 causal -> rows 0-2 see nothing: output 0, lse +inf."""
    q, k, v = (torch.randn(1, n, 2, 8, dtype=f64) for n in (5, 2, 2))
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out[0, :3].abs().max() == 0 and torch.isposinf(lse[0, :, :3]).all()
    assert lse[0, :, 3:].isfinite().all()
    out_ref, lse_ref = attention_ref(q, k, v, causal=True)
    assert_close_to_golden(out, out_ref, floor=1e-12)
    assert_close_to_golden(lse, lse_ref, floor=1e-12, name="lse")


@pytest.mark.parametrize(
    "window,causal,seqlen_q,seqlen_k,visible",
    [
        # A side >= seqlen_k is unbounded (flash-attn's clamp); causal sets right = 0.
        pytest.param((9, 0), False, 3, 4, [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], id="left>=Sk-is-causal"),
        pytest.param((-1, 4), False, 3, 4, [[1] * 4] * 3, id="right>=Sk-is-full"),
        pytest.param((1, 7), True, 3, 4, [[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], id="causal-overrides-right"),
        # (left, -1): right becomes seqlen_k, which bites rows more than seqlen_k above the diagonal.
        pytest.param((0, -1), False, 5, 2, [[0, 0], [1, 0], [1, 1], [1, 1], [0, 1]], id="right=-1-is-seqlen_k"),
        pytest.param((-1, 0), False, 2, 3, [[1, 1, 0], [1, 1, 1]], id="(-1,0)-is-causal"),
    ],
)
def test_window_rules(window, causal, seqlen_q, seqlen_k, visible):
    q = torch.randn(1, seqlen_q, 1, 8, dtype=f64)
    k, v = torch.randn(1, seqlen_k, 1, 8, dtype=f64), torch.randn(1, seqlen_k, 1, 8, dtype=f64)
    out = fa.flash_attn_func(q, k, v, causal=causal, window_size=window)
    keep = torch.tensor(visible, dtype=torch.bool)
    s = (torch.einsum("qd,kd->qk", q[0, :, 0], k[0, :, 0]) / math.sqrt(8)).masked_fill(~keep, -math.inf)
    want = torch.softmax(s, -1).nan_to_num(0) @ v[0, :, 0]
    torch.testing.assert_close(out[0, :, 0], want, rtol=0, atol=1e-12)


def test_alibi_causal_lse_is_flash_attns():
    """With the causal kernel flash-attn adds ``slope * j``: its lse is ``slope * diag`` above the
    one of ``-slope * |diag - j|``; the outputs agree."""
    q, k, v = torch.randn(2, 6, 3, 8, dtype=f64), torch.randn(2, 9, 3, 8, dtype=f64), torch.randn(2, 9, 3, 8, dtype=f64)
    slopes = torch.rand(3, dtype=f64)
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True)
    out_local, lse_local, _ = fa.flash_attn_func(
        q, k, v, window_size=(8, 0), alibi_slopes=slopes, return_attn_probs=True
    )
    diag = torch.arange(6, dtype=f64) + 3
    torch.testing.assert_close(out, out_local, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, lse_local + slopes.view(1, 3, 1) * diag, rtol=0, atol=1e-12)
    # left >= Sk counts as -1 (flash-attn's clamp): (9, 0) is the causal kernel, shift included.
    _, lse_clamped, _ = fa.flash_attn_func(q, k, v, window_size=(9, 0), alibi_slopes=slopes, return_attn_probs=True)
    torch.testing.assert_close(lse_clamped, lse, rtol=0, atol=1e-12)


def test_lse_is_differentiable():
    """flash-attn drops the lse's gradient; subquad's is the true one (float64 gradcheck-like)."""
    q, k, v = (torch.randn(2, n, 4, 16, dtype=f64, requires_grad=True) for n in (7, 11, 11))
    slopes = torch.rand(4, dtype=f64)
    _, lse, _ = fa.flash_attn_func(q, k, v, causal=True, softcap=3.0, alibi_slopes=slopes, return_attn_probs=True)
    _, lse_ref = attention_ref(q, k, v, causal=True, softcap=3.0, alibi_slopes=slopes)
    g = torch.randn(lse.shape, dtype=f64)
    for a, b, name in zip(grads(lse, (q, k), g), grads(lse_ref, (q, k), g), "qk"):
        assert_close_to_golden(a, b, floor=1e-10, name=f"d{name} of the lse")


def test_qkvpacked_equals_unpacked_with_its_gradient():
    qkv = torch.randn(2, 37, 3, 4, 24, dtype=f64, requires_grad=True)
    out, lse, _probs = fa.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(5, 3), return_attn_probs=True)
    q, k, v = (t.detach().requires_grad_() for t in qkv.unbind(2))
    out_ref, lse_ref = attention_ref(q, k, v, causal=True, window_size=(5, 3))
    assert_close_to_golden(out, out_ref, floor=1e-12)
    assert_close_to_golden(lse, lse_ref, floor=1e-12, name="lse")
    g = torch.randn(out.shape, dtype=f64)
    (dqkv,) = grads(out, (qkv,), g)
    assert dqkv.shape == qkv.shape
    assert_close_to_golden(dqkv, torch.stack(grads(out_ref, (q, k, v), g), dim=2), floor=1e-10, name="dqkv")


def test_dropout_is_unbiased():
    """subquad's dropout (not flash-attn's generator): on average, the output without dropout.

    One call over 800 copies of the batch: each copy draws its own masks.
    """
    q, k, v = (torch.randn(1, n, 2, 8, dtype=f64) for n in (6, 10, 10))
    plain = fa.flash_attn_func(q, k, v, causal=True)
    runs = fa.flash_attn_func(*(t.expand(800, -1, -1, -1) for t in (q, k, v)), 0.3, causal=True, deterministic=True)
    assert not torch.equal(runs[0], runs[1])
    spread = runs.std(0) / math.sqrt(len(runs))
    assert ((runs.mean(0) - plain[0]).abs() <= 5 * spread + 1e-9).all()
    q.requires_grad_()
    out = fa.flash_attn_func(q, k, v, 0.3, softcap=4.0)  # flash-attn refuses softcap with dropout
    (dq,) = grads(out.sum(), (q,), None)
    assert dq.isfinite().all() and dq.abs().sum() > 0


def test_accepts_what_flash_attn_refuses():
    """fp32/fp64, head dims over 256 and not multiples of 8, value dims of their own, empty batches."""
    q, k, v = (
        torch.randn(1, 5, 2, 300, dtype=f64),
        torch.randn(1, 7, 1, 300, dtype=f64),
        torch.randn(1, 7, 1, 13, dtype=f64),
    )
    out = fa.flash_attn_func(q, k, v, causal=True)
    assert out.shape == (1, 5, 2, 13)
    assert_close_to_golden(out, attention_ref(q, k, v, causal=True)[0], floor=1e-12)
    empty = fa.flash_attn_func(torch.randn(0, 4, 2, 8), torch.randn(0, 4, 2, 8), torch.randn(0, 4, 2, 8))
    assert empty.shape == (0, 4, 2, 8)
    none = torch.zeros(1, dtype=torch.int32)
    assert fa.flash_attn_varlen_func(
        torch.randn(0, 2, 8), torch.randn(0, 2, 8), torch.randn(0, 2, 8), none, none, 0, 0
    ).shape == (0, 2, 8)
    paged = fa.flash_attn_with_kvcache(
        torch.randn(2, 1, 2, 8),
        torch.randn(4, 5, 2, 8),
        torch.randn(4, 5, 2, 8),
        cache_seqlens=7,
        block_table=torch.tensor([[3, 0], [1, 2]], dtype=torch.int32),  # pages of 5 keys
    )
    assert paged.shape == (2, 1, 2, 8)


# ----------------------------------------------------------------------------- packed sequences
def unpadded(q, k, v, query_padding_mask, key_padding_mask):
    q_unpad, indices_q, cu_q, max_q, _ = unpad_input(q, query_padding_mask)
    k_unpad, indices_k, cu_k, max_k, _ = unpad_input(k, key_padding_mask)
    v_unpad = unpad_input(v, key_padding_mask)[0]
    leaves = [t.detach().requires_grad_() for t in (q_unpad, k_unpad, v_unpad)]
    return leaves, cu_q, cu_k, max_q, max_k, indices_q, indices_k


_MODES = ["random", "full", "third", "empty"]


def _varlen_cases():
    rng = random.Random(1)
    cases = []
    for n, (causal, local, alibi, softcap) in enumerate(rng.sample(_AXES, 9)):
        mha, mode = _MHA[n % 3], _MODES[n % 4]
        dtype = [torch.float32, torch.float32, torch.bfloat16, f64][(n // 2) % 4]
        d = _DIMS[(n + 1) % len(_DIMS)]
        sq, sk = [(113, 203), (108, 256), (1, 147), (203, 113)][(n + 1) % 4]
        cases.append(
            pytest.param(
                mha,
                causal,
                local,
                alibi,
                softcap,
                mode,
                d,
                sq,
                sk,
                dtype,
                n % 3 == 1,
                id=f"{mha}-{'causal' if causal else 'full'}{'-local' if local else ''}"
                f"{'-alibi' if alibi else ''}{'-softcap' if softcap else ''}-{mode}-d{d}-{sq}x{sk}-"
                f"{str(dtype)[6:]}{'-kvpacked' if n % 3 == 1 else ''}",
            )
        )
    return cases


@pytest.mark.parametrize("mha,causal,local,alibi,softcap,mode,d,seqlen_q,seqlen_k,dtype,kvpacked", _varlen_cases())
def test_flash_attn_varlen_output(mha, causal, local, alibi, softcap, mode, d, seqlen_q, seqlen_k, dtype, kvpacked):
    gen = torch.Generator().manual_seed(seqlen_k * 3 + d)
    batch = 3
    nheads, nheads_k = _heads(mha, False)
    window = (-1, -1) if not local else tuple(torch.randint(0, seqlen_k, (2,), generator=gen).tolist())
    q0 = torch.randn(batch, seqlen_q, nheads, d, generator=gen, dtype=f64) * (softcap / 8 if softcap else 1.0)
    k0 = torch.randn(batch, seqlen_k, nheads_k, d, generator=gen, dtype=f64)
    v0 = torch.randn(batch, seqlen_k, nheads_k, d, generator=gen, dtype=f64)
    qpm = padding_mask(seqlen_q, batch, mode, gen)
    kpm = padding_mask(seqlen_k, batch, mode, gen, empty=1)  # "empty": sequence 1 has queries and no key
    slopes = torch.rand(batch, nheads, generator=gen) * 0.3 if alibi else None
    q, k, v = three(q0, k0, v0, dtype)
    q_ref, k_ref, v_ref = three(q0, k0, v0, f64)
    (q_u, k_u, v_u), cu_q, cu_k, max_q, max_k, idx_q, idx_k = unpadded(q, k, v, qpm, kpm)
    opts = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    if kvpacked:
        kv_u = torch.stack([k_u, v_u], dim=1).detach().requires_grad_()
        out_u, lse, probs = fa.flash_attn_varlen_kvpacked_func(
            q_u, kv_u, cu_q, cu_k, max_q, max_k, return_attn_probs=True, **opts
        )
    else:
        out_u, lse, probs = fa.flash_attn_varlen_func(
            q_u, k_u, v_u, cu_q, cu_k, max_q, max_k, return_attn_probs=True, **opts
        )
    out_ref, lse_ref = attention_ref(q_ref, k_ref, v_ref, qpm, kpm, **opts)
    out_pt, lse_pt = attention_ref(q, k, v, qpm, kpm, upcast=False, reorder_ops=True, **opts)

    assert out_u.shape == (int(cu_q[-1]), nheads, d) and lse.shape == (nheads, int(cu_q[-1])) and lse.is_contiguous()
    assert probs.shape == (0,)
    floor = 1e-10 if dtype == f64 else None
    out = pad_input(out_u, idx_q, batch, seqlen_q)
    check_like_flash(out, out_ref, None if dtype == f64 else out_pt, floor=floor)
    # lse (H, total_q) against the golden's rows of valid queries.
    golden_lse = lse_ref.permute(0, 2, 1)[qpm].t()
    naive_lse = lse_pt.permute(0, 2, 1)[qpm].t().float()
    check_like_flash(
        lse, golden_lse, None if dtype == f64 else naive_lse, name="lse", floor=floor if dtype == f64 else 1e-5
    )

    g = torch.randn(out.shape, generator=gen, dtype=f64).masked_fill(~qpm.view(batch, seqlen_q, 1, 1), 0)
    g_u = g[qpm].to(dtype)
    leaves = (q_u, kv_u) if kvpacked else (q_u, k_u, v_u)
    got = grads(out_u, leaves, g_u)
    if kvpacked:
        got = (got[0], *got[1].unbind(1))
    want = grads(out_ref, (q_ref, k_ref, v_ref), g)
    naive = grads(out_pt, (q, k, v), g.to(dtype))
    for name, a, b, c, idx, seqlen in zip(
        ("dq", "dk", "dv"), got, want, naive, (idx_q, idx_k, idx_k), (seqlen_q, seqlen_k, seqlen_k)
    ):
        a = pad_input(a, idx, batch, seqlen)
        assert_close_to_golden(a, b, None if dtype == f64 else c, fudge=3.0, floor=floor, name=name)


def test_varlen_qkvpacked_equals_the_padded_batch():
    gen = torch.Generator().manual_seed(3)
    mask = padding_mask(41, 3, "third", gen)
    qkv = torch.randn(3, 41, 3, 2, 16, generator=gen, dtype=f64)
    qkv_u, indices, cu, max_s, _used = unpad_input(qkv, mask)
    qkv_u.requires_grad_()
    out_u, _lse, _ = fa.flash_attn_varlen_qkvpacked_func(qkv_u, cu, max_s, causal=True, return_attn_probs=True)
    q, k, v = (t.requires_grad_() for t in qkv.clone().unbind(2))
    out_ref, _lse_ref = attention_ref(q, k, v, mask, mask, causal=True)
    assert_close_to_golden(pad_input(out_u, indices, 3, 41), out_ref, floor=1e-12)
    g = torch.randn(out_ref.shape, dtype=f64).masked_fill(~mask.view(3, 41, 1, 1), 0)
    (dqkv_u,) = grads(out_u, (qkv_u,), g[mask])
    want = torch.stack(grads(out_ref, (q, k, v), g), dim=2)
    assert_close_to_golden(pad_input(dqkv_u, indices, 3, 41), want, floor=1e-10, name="dqkv")


def _paged(k_dense: Tensor, page: int, gen: torch.Generator, spare: int = 3):
    """flash-attn's ``_generate_block_kvcache``: the cache's pages shuffled into a pool."""
    batch, seqlen = k_dense.shape[:2]
    per_seq = -(-seqlen // page)
    num_blocks = per_seq * batch * spare
    pool = torch.randn(num_blocks, page, *k_dense.shape[2:], generator=gen, dtype=k_dense.dtype)
    table = torch.randperm(num_blocks, generator=gen)[: batch * per_seq].view(batch, per_seq).int()
    padded = torch.nn.functional.pad(k_dense, (0, 0, 0, 0, 0, per_seq * page - seqlen))
    pool[table.long().flatten()] = padded.reshape(batch * per_seq, page, *k_dense.shape[2:])
    return pool, table


def test_varlen_paged_keys():
    """``block_table`` in flash_attn_varlen_func: keys gathered from pages of any size; gradients reach the pool."""
    gen = torch.Generator().manual_seed(4)
    batch, seqlen_q, seqlen_k, page = 3, 30, 70, 16
    q = torch.randn(batch, seqlen_q, 4, 32, generator=gen, dtype=f64)
    k, v = (torch.randn(batch, seqlen_k, 2, 32, generator=gen, dtype=f64) for _ in range(2))
    qpm, kpm = padding_mask(seqlen_q, batch, "third", gen), padding_mask(seqlen_k, batch, "third", gen)
    q_u, indices_q, cu_q, max_q, _ = unpad_input(q, qpm)
    _, _, cu_k, max_k, _ = unpad_input(k, kpm)
    k_pool, table = _paged(k, page, gen)
    v_pool, _ = _paged(v, page, torch.Generator().manual_seed(4))
    v_pool[table.long().flatten()] = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, 10)).reshape(-1, page, 2, 32)
    k_pool.requires_grad_()
    out_u = fa.flash_attn_varlen_func(
        q_u, k_pool, v_pool, cu_q, cu_k, max_q, max_k, causal=True, window_size=(20, 5), block_table=table
    )
    out_ref, _ = attention_ref(q, k, v, qpm, kpm, causal=True, window_size=(20, 5))
    assert_close_to_golden(pad_input(out_u, indices_q, batch, seqlen_q), out_ref, floor=1e-12)
    (dk_pool,) = grads(out_u.sum(), (k_pool,), None)
    unused = torch.ones(k_pool.shape[0], dtype=torch.bool)
    unused[table.long().flatten()] = False
    assert dk_pool[unused].abs().max() == 0 and dk_pool.abs().sum() > 0


def test_varlen_rows_past_the_offsets_give_zero():
    """flash-attn leaves rows past ``cu_seqlens_q[-1]`` unwritten; here they are 0 (lse +inf)."""
    q, k, v = torch.randn(10, 2, 8, dtype=f64), torch.randn(12, 2, 8, dtype=f64), torch.randn(12, 2, 8, dtype=f64)
    cu_q, cu_k = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 5, 9], dtype=torch.int32)
    out, lse, _ = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 5, return_attn_probs=True)
    assert out.shape == (10, 2, 8) and out[7:].abs().max() == 0 and torch.isposinf(lse[:, 7:]).all()
    head = fa.flash_attn_varlen_func(q[:7], k[:9], v[:9], cu_q.long(), cu_k.long(), 4, 5)  # int64 offsets accepted
    torch.testing.assert_close(out[:7], head, rtol=0, atol=0)


# ----------------------------------------------------------------------------- kvcache
_KV_CASES = [
    # (seqlen_q, seqlen_k, d, mha, causal, local, alibi, new_kv, rotary_fraction, interleaved, page, leftpad, batch_idx, dtype)
    pytest.param(
        1,
        128,
        64,
        "gqa",
        True,
        False,
        False,
        True,
        0.5,
        False,
        None,
        False,
        None,
        torch.float32,
        id="decode-gqa-causal-rotary-neox",
    ),
    pytest.param(
        3,
        339,
        59,
        "mha",
        True,
        True,
        True,
        True,
        1.0,
        True,
        None,
        True,
        None,
        torch.float32,
        id="causal-local-alibi-rotary-gptj-leftpad",
    ),
    pytest.param(
        16,
        200,
        64,
        "mqa",
        False,
        False,
        True,
        True,
        0.5,
        True,
        48,
        False,
        None,
        torch.float32,
        id="paged48-alibi-rotary-noncausal",
    ),
    pytest.param(
        5,
        256,
        32,
        "gqa",
        True,
        False,
        False,
        False,
        0.0,
        False,
        64,
        True,
        None,
        f64,
        id="paged64-leftpad-no-new-kv-float64",
    ),
    pytest.param(
        4,
        100,
        40,
        "mha",
        True,
        False,
        True,
        True,
        0.0,
        False,
        None,
        True,
        "perm",
        torch.float32,
        id="batch-idx-permuted-leftpad",
    ),
    pytest.param(
        2,
        90,
        16,
        "gqa",
        False,
        True,
        False,
        True,
        1.0,
        True,
        None,
        False,
        "dup",
        f64,
        id="batch-idx-duplicates-local-rotary",
    ),
    pytest.param(
        8,
        160,
        64,
        "mha",
        True,
        False,
        False,
        True,
        0.5,
        False,
        None,
        False,
        None,
        torch.bfloat16,
        id="bfloat16-causal-rotary",
    ),
]


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k,d,mha,causal,local,alibi,new_kv,rotary_fraction,interleaved,page,leftpad,batch_idx,dtype",
    _KV_CASES,
)
def test_flash_attn_kvcache(
    seqlen_q,
    seqlen_k,
    d,
    mha,
    causal,
    local,
    alibi,
    new_kv,
    rotary_fraction,
    interleaved,
    page,
    leftpad,
    batch_idx,
    dtype,
):
    gen = torch.Generator().manual_seed(seqlen_k + d)
    batch, nheads = 3, 6
    nheads_k = {"mha": 6, "mqa": 1, "gqa": 3}[mha]
    batch_cache = batch if batch_idx is None else 5
    rotary_dim = int(rotary_fraction * d) // 2 * 2
    window = (-1, -1) if not local else tuple(torch.randint(0, seqlen_k, (2,), generator=gen).tolist())
    seqlen_new = seqlen_q
    q = torch.randn(batch, seqlen_q, nheads, d, generator=gen, dtype=f64).to(dtype)
    k = torch.randn(batch, seqlen_new, nheads_k, d, generator=gen, dtype=f64).to(dtype) if new_kv else None
    v = torch.randn(batch, seqlen_new, nheads_k, d, generator=gen, dtype=f64).to(dtype) if new_kv else None
    k_cache = torch.randn(batch_cache, seqlen_k, nheads_k, d, generator=gen, dtype=f64).to(dtype)
    v_cache = torch.randn(batch_cache, seqlen_k, nheads_k, d, generator=gen, dtype=f64).to(dtype)
    cache_seqlens = torch.randint(
        0 if new_kv else 1,
        seqlen_k - seqlen_new + 1 if new_kv else seqlen_k + 1,
        (batch,),
        generator=gen,
        dtype=torch.int32,
    )
    cache_leftpad = None
    if leftpad:
        cache_leftpad = torch.stack(
            [torch.randint(0, max(int(n), 1), (1,), generator=gen)[0] for n in cache_seqlens]
        ).int()
    cache_batch_idx = None
    if batch_idx == "perm":
        cache_batch_idx = torch.randperm(batch_cache, generator=gen)[:batch].int()
    elif batch_idx == "dup":
        cache_batch_idx = torch.tensor([2, 0, 2], dtype=torch.int32)
        cache_seqlens[2] = cache_seqlens[0]  # two sequences share row 2 and its keys (no write conflict below)
        k[2], v[2] = k[0], v[0]
    rows = torch.arange(batch) if cache_batch_idx is None else cache_batch_idx.long()
    slopes = torch.rand(batch, nheads, generator=gen) * 0.3 if alibi else None
    cos = sin = None
    q_ro, k_ro = q, k
    if rotary_dim:
        angle = torch.rand(seqlen_k + seqlen_q + (page or 0), rotary_dim // 2, generator=gen, dtype=f64) * 2 * math.pi
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
        pos = cache_seqlens.long()[:, None] + torch.arange(seqlen_q)
        q_ro = rotary_ref(
            q, cos, sin, pos if (causal or local) else cache_seqlens.long()[:, None].expand(-1, seqlen_q), interleaved
        )
        k_ro = rotary_ref(k, cos, sin, cache_seqlens.long()[:, None] + torch.arange(seqlen_new), interleaved)
    # The cache as the reference sees it: the selected rows with the (rotated) new keys written in.
    k_cache_ref, v_cache_ref = k_cache[rows].clone(), v_cache[rows].clone()
    arange = torch.arange(seqlen_k)
    filled = cache_seqlens.long()[:, None] + (seqlen_new if new_kv else 0)
    if new_kv:
        update = (arange >= cache_seqlens.long()[:, None]) & (arange < filled)
        k_cache_ref[update] = k_ro.flatten(0, 1)
        v_cache_ref[update] = v.flatten(0, 1)
    key_padding_mask = arange < filled
    if leftpad:
        key_padding_mask &= arange >= cache_leftpad.long()[:, None]
    if page is None:
        k_arg, v_arg, table = k_cache, v_cache, None
    else:
        k_arg, table = _paged(k_cache, page, gen)
        v_arg, _ = _paged(v_cache, page, gen)
        v_arg[table.long().flatten()] = torch.nn.functional.pad(
            v_cache, (0, 0, 0, 0, 0, table.shape[1] * page - seqlen_k)
        ).reshape(-1, page, nheads_k, d)
    out, lse = fa.flash_attn_with_kvcache(
        q,
        k_arg,
        v_arg,
        k,
        v,
        rotary_cos=cos,
        rotary_sin=sin,
        cache_seqlens=cache_seqlens,
        cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad,
        block_table=table,
        causal=causal,
        window_size=window,
        rotary_interleaved=interleaved,
        alibi_slopes=slopes,
        num_splits=3,
        return_softmax_lse=True,
    )
    opts = dict(causal=causal, window_size=window, alibi_slopes=slopes, key_leftpad=cache_leftpad)
    out_ref, lse_ref = attention_ref(
        q_ro.double(), k_cache_ref.double(), v_cache_ref.double(), None, key_padding_mask, **opts
    )
    out_pt, _ = attention_ref(
        q_ro, k_cache_ref, v_cache_ref, None, key_padding_mask, upcast=False, reorder_ops=True, **opts
    )
    assert out.shape == (batch, seqlen_q, nheads, d) and lse.shape == (batch, nheads, seqlen_q)
    floor = 1e-10 if dtype == f64 else None
    # flash-attn's kvcache test allows 3x (5x with ALiBi) the plain-PyTorch error.
    check_like_flash(out, out_ref, None if dtype == f64 else out_pt, fudge=5.0 if alibi else 3.0, floor=floor)
    check_like_flash(lse, lse_ref, None, name="lse", floor=1e-10 if dtype == f64 else 2e-3)
    if new_kv:  # the cache was written in place
        if page is None:
            got_k, got_v = k_cache[rows], v_cache[rows]
        else:
            got_k = k_arg[table.long().flatten()].reshape(batch, -1, nheads_k, d)[:, :seqlen_k]
            got_v = v_arg[table.long().flatten()].reshape(batch, -1, nheads_k, d)[:, :seqlen_k]
        torch.testing.assert_close(got_k, k_cache_ref, rtol=1e-3, atol=1e-3)
        assert torch.equal(got_v, v_cache_ref)


def test_kvcache_decode_steps_match_one_prefill():
    """Appending one token at a time (int cache_seqlens, non-contiguous cache) equals causal attention over all of them."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 9, n, 16, generator=gen, dtype=f64) for n in (4, 2, 2))
    k_cache = torch.zeros(2, 2, 12, 16, dtype=f64).transpose(1, 2)  # (B, S, Hk, D) view of (B, Hk, S, D)
    v_cache = torch.zeros(2, 12, 2, 16, dtype=f64)
    steps = [
        fa.flash_attn_with_kvcache(
            q[:, t : t + 1], k_cache, v_cache, k[:, t : t + 1], v[:, t : t + 1], cache_seqlens=t, causal=True
        )
        for t in range(9)
    ]
    want, _ = attention_ref(q, k, v, causal=True)
    assert_close_to_golden(torch.cat(steps, dim=1), want, floor=1e-12)
    assert torch.equal(k_cache[:, :9], k) and k_cache[:, 9:].abs().max() == 0


def test_kvcache_runs_one_varlen_call_over_the_flattened_cache(monkeypatch):
    """A flattenable cache with distinct rows (permuted, left-padded): one subquad.varlen_attention
    call, no per-sequence loop; duplicate rows fall back to one sequence at a time (views)."""
    from subquad.compat.flash_attn import _run

    calls = []
    real = subquad.varlen_attention
    monkeypatch.setattr(
        subquad, "varlen_attention", lambda *a, **kw: calls.append(kw["seqused_k"].tolist()) or real(*a, **kw)
    )
    monkeypatch.setattr(_run, "per_sequence", lambda *a, **kw: pytest.fail("per-sequence loop"))
    q, k_cache, v_cache = (
        torch.randn(3, 2, 2, 8, dtype=f64),
        torch.randn(5, 20, 1, 8, dtype=f64),
        torch.randn(5, 20, 1, 8, dtype=f64),
    )
    seqlens, leftpad, rows = (
        torch.tensor([9, 4, 12], dtype=torch.int32),
        torch.tensor([2, 0, 5], dtype=torch.int32),
        torch.tensor([3, 1, 4], dtype=torch.int32),
    )
    out = fa.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, cache_batch_idx=rows, cache_leftpad=leftpad, causal=True
    )
    assert calls == [[0, 4, 7, 7]]  # a leading sequence of no keys and no queries, then rows 1, 3, 4 in order
    for b in range(3):
        r, lp, n = int(rows[b]), int(leftpad[b]), int(seqlens[b])
        want, _ = attention_ref(q[b : b + 1], k_cache[r : r + 1, lp:n], v_cache[r : r + 1, lp:n], causal=True)
        assert_close_to_golden(out[b : b + 1], want, floor=1e-12, name=f"sequence {b}")
    monkeypatch.undo()
    dup = fa.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, cache_batch_idx=torch.tensor([1, 1, 4], dtype=torch.int32)
    )
    want, _ = attention_ref(q[:2], k_cache[1:2, :9].expand(2, -1, -1, -1), v_cache[1:2, :9].expand(2, -1, -1, -1))
    assert_close_to_golden(dup[:1], want[:1], floor=1e-12)


def test_nothing_seqlen_q_by_seqlen_k_is_formed():
    """Every tensor any op makes during the call (tiles included) is well under Sq x Sk elements."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, Tensor)]
            self.numel = max([self.numel, *sizes])
            return out

    S = 4096
    q, k, v = (torch.randn(1, S, 1, 8) for _ in range(3))
    with Largest() as seen:
        fa.flash_attn_func(q, k, v, causal=True, window_size=(64, 0), softcap=5.0, alibi_slopes=torch.tensor([0.1]))
    assert 0 < seen.numel <= S * S // 2, seen.numel


# ----------------------------------------------------------------------------- rotary and bert_padding
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_apply_rotary_emb(interleaved):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 7, 3, 20, generator=gen, dtype=f64, requires_grad=True)
    angle = torch.rand(12, 6, generator=gen, dtype=f64) * 6.3
    cos, sin = angle.cos(), angle.sin()
    offsets = torch.tensor([0, 8], dtype=torch.int32)
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    pos = offsets.long()[:, None] + torch.arange(7)
    inside = pos < 12  # positions past the table rotate by angle 0, as flash-attn's kernel does
    want = torch.where(inside[..., None, None], rotary_ref(x, cos, sin, pos.clamp(max=11), interleaved), x)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    assert torch.equal(out[..., 12:], x[..., 12:])
    (dx,) = grads(out, (x,), torch.ones_like(out))
    assert dx.isfinite().all()
    packed = apply_rotary_emb(
        x.detach()[0],
        cos,
        sin,
        interleaved=interleaved,
        seqlen_offsets=3,
        cu_seqlens=torch.tensor([0, 2, 7], dtype=torch.int32),
        max_seqlen=5,
    )
    pos = torch.tensor([0, 1, 0, 1, 2, 3, 4]) + 3
    torch.testing.assert_close(packed, rotary_ref(x.detach()[0], cos, sin, pos, interleaved), rtol=0, atol=1e-12)
    y = x.detach().clone()
    assert apply_rotary_emb(y, cos, sin, interleaved=interleaved, inplace=True) is y


def test_bert_padding_round_trip_and_flash_attn_return_values():
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(3, 6, 4, generator=gen, dtype=f64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    unused = torch.zeros(3, 6, dtype=torch.bool)
    unused[0, 3] = True
    packed, indices, cu, max_seqlen, used = unpad_input(hidden, mask, unused)
    assert torch.equal(indices, torch.tensor([0, 1, 2, 3, 6, 7, 8, 9, 10, 11]))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 4, 10, 10] and max_seqlen == 6 and isinstance(max_seqlen, int)
    assert used.dtype == torch.int32 and used.tolist() == [3, 6, 0]
    back = pad_input(packed, indices, 3, 6)
    keep = (mask | unused)[..., None]
    assert torch.equal(back, hidden * keep)
    (dh,) = grads(back.sum(), (hidden,), None)
    assert torch.equal(dh, keep.expand_as(dh).to(f64))
    assert torch.equal(index_first_axis(hidden.detach().flatten(0, 1), indices), hidden.detach().flatten(0, 1)[indices])
    assert index_put_first_axis(packed.detach(), indices, 18).shape == (18, 4)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    packed2, indices2, cu2, max2 = unpad_input_for_concatenated_sequences(hidden, lengths)
    assert cu2.tolist() == [0, 2, 5, 8, 10, 16] and max2 == 6 and packed2.shape == (16, 4)
    assert indices2.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]


# ----------------------------------------------------------------------------- refusals
def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


_REFUSALS = [
    (
        "q-not-4d",
        lambda: fa.flash_attn_func(_t(2, 4, 8), _t(2, 4, 2, 8), _t(2, 4, 2, 8)),
        r"q must have 4 dims \(batch_size, seqlen_q",
    ),
    (
        "k-head-dim",
        lambda: fa.flash_attn_func(_t(2, 4, 2, 8), _t(2, 4, 2, 16), _t(2, 4, 2, 8)),
        r"k must have shape \(batch_size, seqlen_k, nheads_k, headdim\) = \(2, 4, 2, 8\), got \(2, 4, 2, 16\)",
    ),
    (
        "k-batch",
        lambda: fa.flash_attn_func(_t(2, 4, 2, 8), _t(3, 4, 2, 8), _t(3, 4, 2, 8)),
        r"k must have shape .* = \(2, \*, \*, \*\), got \(3, 4, 2, 8\)",
    ),
    (
        "v-seqlen",
        lambda: fa.flash_attn_func(_t(2, 4, 2, 8), _t(2, 5, 2, 8), _t(2, 4, 2, 8)),
        r"v must have shape .* = \(2, 5, 2, \*\), got \(2, 4, 2, 8\)",
    ),
    (
        "int-dtype",
        lambda: fa.flash_attn_func(
            torch.ones(1, 2, 1, 8, dtype=torch.long),
            torch.ones(1, 2, 1, 8, dtype=torch.long),
            torch.ones(1, 2, 1, 8, dtype=torch.long),
        ),
        r"FlashAttention only support fp16 and bf16 data type .* got q torch.int64",
    ),
    (
        "dtype-mismatch",
        lambda: fa.flash_attn_func(_t(1, 2, 1, 8), _t(1, 2, 1, 8, dtype=torch.float16), _t(1, 2, 1, 8)),
        r"query and key must have the same dtype, got torch.float32 and torch.float16",
    ),
    (
        "heads",
        lambda: fa.flash_attn_func(_t(1, 2, 4, 8), _t(1, 2, 3, 8), _t(1, 2, 3, 8)),
        r"Number of heads in key/value must divide number of heads in query, got 4 query heads and 3",
    ),
    (
        "alibi-shape",
        lambda: fa.flash_attn_func(_t(2, 3, 4, 8), _t(2, 3, 4, 8), _t(2, 3, 4, 8), alibi_slopes=torch.rand(3)),
        r"alibi_slopes must have shape \(nheads,\) or \(batch_size, nheads\) = \(4,\) or \(2, 4\), got \(3,\)",
    ),
    (
        "alibi-dtype",
        lambda: fa.flash_attn_func(
            _t(2, 3, 4, 8), _t(2, 3, 4, 8), _t(2, 3, 4, 8), alibi_slopes=torch.ones(4, dtype=torch.long)
        ),
        r"ALiBi slopes must have dtype fp32",
    ),
    (
        "window",
        lambda: fa.flash_attn_func(_t(1, 3, 1, 8), _t(1, 3, 1, 8), _t(1, 3, 1, 8), window_size=5),
        r"window_size must be \(left, right\)",
    ),
    (
        "qkv-packed",
        lambda: fa.flash_attn_qkvpacked_func(_t(1, 3, 2, 1, 8)),
        r"qkv must have shape \(batch_size, seqlen, 3, nheads, headdim\) = \(\*, \*, 3, \*, \*\), got \(1, 3, 2, 1, 8\)",
    ),
    (
        "kv-packed",
        lambda: fa.flash_attn_kvpacked_func(_t(1, 3, 1, 8), _t(1, 3, 3, 1, 8)),
        r"kv must have shape .* = \(\*, \*, 2, \*, \*\)",
    ),
    (
        "varlen-qkv-packed",
        lambda: fa.flash_attn_varlen_qkvpacked_func(_t(4, 2, 1, 8), torch.tensor([0, 4], dtype=torch.int32), 4),
        r"qkv must have shape \(total, 3, nheads, headdim\)",
    ),
    (
        "varlen-kv-packed",
        lambda: fa.flash_attn_varlen_kvpacked_func(
            _t(4, 1, 8),
            _t(4, 2, 8),
            torch.tensor([0, 4], dtype=torch.int32),
            torch.tensor([0, 4], dtype=torch.int32),
            4,
            4,
        ),
        r"kv must have 4 dims \(total_k, 2, nheads_k, headdim\)",
    ),
    (
        "cu-dtype",
        lambda: fa.flash_attn_varlen_func(
            _t(4, 1, 8),
            _t(4, 1, 8),
            _t(4, 1, 8),
            torch.tensor([0.0, 4.0]),
            torch.tensor([0, 4], dtype=torch.int32),
            4,
            4,
        ),
        r"cu_seqlens_q must have dtype int32 \(or int64\), got torch.float32",
    ),
    (
        "cu-k-size",
        lambda: fa.flash_attn_varlen_func(
            _t(4, 1, 8),
            _t(4, 1, 8),
            _t(4, 1, 8),
            torch.tensor([0, 4], dtype=torch.int32),
            torch.tensor([0, 2, 4], dtype=torch.int32),
            4,
            4,
        ),
        r"cu_seqlens_k must have shape \(batch_size \+ 1,\) = \(2\), got \(3,\)",
    ),
    (
        "max-seqlen-type",
        lambda: fa.flash_attn_varlen_func(
            _t(4, 1, 8),
            _t(4, 1, 8),
            _t(4, 1, 8),
            torch.tensor([0, 4], dtype=torch.int32),
            torch.tensor([0, 4], dtype=torch.int32),
            4,
            4.0,
        ),
        r"max_seqlen_k must be an int, got 4.0",
    ),
    (
        "max-seqlen-short",
        lambda: fa.flash_attn_varlen_func(
            _t(4, 1, 8),
            _t(4, 1, 8),
            _t(4, 1, 8),
            torch.tensor([0, 4], dtype=torch.int32),
            torch.tensor([0, 4], dtype=torch.int32),
            3,
            4,
        ),
        r"max_seqlen_q=3 is smaller than the longest sequence \(4 tokens\)",
    ),
    (
        "cu-past-total",
        lambda: fa.flash_attn_varlen_func(
            _t(4, 1, 8),
            _t(4, 1, 8),
            _t(4, 1, 8),
            torch.tensor([0, 5], dtype=torch.int32),
            torch.tensor([0, 4], dtype=torch.int32),
            5,
            4,
        ),
        r"cu_seqlens_q\[-1\] == 4",
    ),
    (
        "paged-offsets",
        lambda: fa.flash_attn_varlen_func(
            _t(4, 1, 8),
            _t(6, 4, 1, 8),
            _t(6, 4, 1, 8),
            torch.tensor([0, 4, 2], dtype=torch.int32),
            torch.tensor([0, 2, 4], dtype=torch.int32),
            4,
            2,
            block_table=torch.zeros(2, 1, dtype=torch.int32),
        ),
        r"Expected cu_seqlens_q to start at 0 and never decrease, got \[0, 4, 2\]",
    ),
    (
        "paged-max-seqlen",
        lambda: fa.flash_attn_varlen_func(
            _t(4, 1, 8),
            _t(6, 4, 1, 8),
            _t(6, 4, 1, 8),
            torch.tensor([0, 4], dtype=torch.int32),
            torch.tensor([0, 5], dtype=torch.int32),
            4,
            3,
            block_table=torch.zeros(1, 2, dtype=torch.int32),
        ),
        r"max_seqlen_k=3 is smaller than the longest sequence \(5 tokens\)",
    ),
    (
        "block-table-short",
        lambda: fa.flash_attn_varlen_func(
            _t(4, 1, 8),
            _t(6, 4, 1, 8),
            _t(6, 4, 1, 8),
            torch.tensor([0, 4], dtype=torch.int32),
            torch.tensor([0, 9], dtype=torch.int32),
            4,
            9,
            block_table=torch.tensor([[0, 1]], dtype=torch.int32),
        ),
        r"block_table has 2 pages per sequence \(8 keys\), sequence 0 needs 9 keys",
    ),
    (
        "block-table-page",
        lambda: fa.flash_attn_varlen_func(
            _t(4, 1, 8),
            _t(6, 4, 1, 8),
            _t(6, 4, 1, 8),
            torch.tensor([0, 4], dtype=torch.int32),
            torch.tensor([0, 5], dtype=torch.int32),
            4,
            5,
            block_table=torch.tensor([[0, 6]], dtype=torch.int32),
        ),
        r"block_table\[0\] names pages \[6\] outside \[0, 6\)",
    ),
]

_Q, _KC = (1, 2, 2, 8), (1, 16, 2, 8)
_KV_REFUSALS = [
    ("k-without-v", dict(k=_t(1, 1, 2, 8), cache_seqlens=3), r"If key is supplied, value must also be passed in"),
    ("v-without-k", dict(v=_t(1, 1, 2, 8)), r"v is given without k"),
    (
        "k-without-seqlens",
        dict(k=_t(1, 1, 2, 8), v=_t(1, 1, 2, 8)),
        r"If key is supplied, cache_seqlens must also be passed in",
    ),
    (
        "k-shape",
        dict(k=_t(1, 1, 1, 8), v=_t(1, 1, 2, 8), cache_seqlens=3),
        r"k must have shape \(batch_size, seqlen_new, nheads_k, headdim\) = \(1, \*, 2, 8\)",
    ),
    (
        "k-dtype",
        dict(k=_t(1, 1, 2, 8, dtype=f64), v=_t(1, 1, 2, 8), cache_seqlens=3),
        r"Key and query must have the same dtype",
    ),
    (
        "overflow",
        dict(k=_t(1, 2, 2, 8), v=_t(1, 2, 2, 8), cache_seqlens=15),
        r"cache_seqlens\[0\] \+ seqlen_new = 17 keys do not fit the KV cache's seqlen 16",
    ),
    ("seqlens-range", dict(cache_seqlens=torch.tensor([17], dtype=torch.int32)), r"cache_seqlens must be in \[0, 16\]"),
    ("seqlens-dtype", dict(cache_seqlens=torch.tensor([3.0])), r"cache_seqlens must have dtype int32"),
    (
        "leftpad",
        dict(cache_seqlens=torch.tensor([3], dtype=torch.int32), cache_leftpad=torch.tensor([4], dtype=torch.int32)),
        r"cache_leftpad must be in \[0, cache_seqlens\], got cache_leftpad\[0\] = 4",
    ),
    (
        "batch-idx-range",
        dict(cache_batch_idx=torch.tensor([1], dtype=torch.int32)),
        r"cache_batch_idx must be in \[0, 1\)",
    ),
    (
        "rotary-without-k",
        dict(rotary_cos=_t(16, 4), rotary_sin=_t(16, 4)),
        r"If rotary cos/sin are provided, new key / value to be appended to KV cache must also be provided",
    ),
    (
        "cos-without-sin",
        dict(k=_t(1, 1, 2, 8), v=_t(1, 1, 2, 8), cache_seqlens=3, rotary_cos=_t(16, 4)),
        r"If rotary cos is provided, rotary sin must also be provided",
    ),
    (
        "sin-without-cos",
        dict(k=_t(1, 1, 2, 8), v=_t(1, 1, 2, 8), cache_seqlens=3, rotary_sin=_t(16, 4)),
        r"rotary_sin is given without rotary_cos",
    ),
    (
        "rotary-dim",
        dict(k=_t(1, 1, 2, 8), v=_t(1, 1, 2, 8), cache_seqlens=3, rotary_cos=_t(16, 5), rotary_sin=_t(16, 5)),
        r"rotary_dim must be <= headdim, got rotary_dim 10 and headdim 8",
    ),
    (
        "rotary-short",
        dict(k=_t(1, 1, 2, 8), v=_t(1, 1, 2, 8), cache_seqlens=3, rotary_cos=_t(15, 4), rotary_sin=_t(15, 4)),
        r"cos/sin seqlen must be at least the seqlen of KV cache, got 15 < 16",
    ),
    (
        "rotary-sin-shape",
        dict(k=_t(1, 1, 2, 8), v=_t(1, 1, 2, 8), cache_seqlens=3, rotary_cos=_t(16, 4), rotary_sin=_t(16, 2)),
        r"rotary_sin must have shape \(seqlen_ro, rotary_dim / 2\) = \(16, 4\)",
    ),
    (
        "rotary-positions",
        dict(
            k=_t(1, 1, 2, 8),
            v=_t(1, 1, 2, 8),
            cache_seqlens=15,
            causal=True,
            rotary_cos=_t(16, 4),
            rotary_sin=_t(16, 4),
        ),
        r"rotary positions reach 16 .* past rotary_cos's 16 rows",
    ),
    (
        "paged-batch-idx",
        dict(block_table=torch.zeros(1, 2, dtype=torch.int32), cache_batch_idx=torch.zeros(1, dtype=torch.int32)),
        r"Paged KVcache does not support cache_batch_idx",
    ),
    ("block-table-dtype", dict(block_table=torch.zeros(1, 2)), r"block_table must have dtype int32"),
]


@pytest.mark.parametrize("name,call,match", _REFUSALS, ids=[r[0] for r in _REFUSALS])
def test_refusals(name, call, match):
    with pytest.raises(RuntimeError, match=match) as info:  # flash-attn's class (TORCH_CHECK)
        call()
    assert isinstance(info.value, (ValueError, TypeError))


@pytest.mark.parametrize("name,kwargs,match", _KV_REFUSALS, ids=[r[0] for r in _KV_REFUSALS])
def test_kvcache_refusals(name, kwargs, match):
    with pytest.raises(RuntimeError, match=match):
        fa.flash_attn_with_kvcache(_t(*_Q), _t(*_KC), _t(*_KC), **kwargs)


def test_kvcache_refuses_a_batch_larger_than_the_cache_and_long_queries():
    with pytest.raises(RuntimeError, match=r"k_cache holds 1 sequences for a batch of 2; pass cache_batch_idx"):
        fa.flash_attn_with_kvcache(_t(2, 1, 2, 8), _t(*_KC), _t(*_KC))
    with pytest.raises(
        RuntimeError, match=r"If key is supplied, it must have seqlen <= the seqlen of the KV cache, got seqlen_q 17"
    ):
        fa.flash_attn_with_kvcache(_t(1, 17, 2, 8), _t(*_KC), _t(*_KC), _t(1, 1, 2, 8), _t(1, 1, 2, 8), cache_seqlens=0)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: apply_rotary_emb(_t(1, 4, 1, 8), _t(4, 5), _t(4, 5)), r"rotary_dim must be <= headdim"),
        (
            lambda: apply_rotary_emb(_t(1, 4, 1, 8), _t(4, 2), _t(4, 3)),
            r"cos and sin must both be \(seqlen_ro, rotary_dim / 2\)",
        ),
        (lambda: apply_rotary_emb(_t(1, 4, 1, 8), _t(3, 2), _t(3, 2)), r"seqlen_ro must be >= seqlen"),
        (
            lambda: apply_rotary_emb(_t(1, 4, 1, 8), _t(5, 2), _t(5, 2), seqlen_offsets=2),
            r"seqlen_offsets \+ seqlen must be <= seqlen_ro, got 2 \+ 4 > 5",
        ),
        (
            lambda: apply_rotary_emb(
                _t(4, 1, 8), _t(5, 2), _t(5, 2), cu_seqlens=torch.tensor([0, 4], dtype=torch.int32)
            ),
            r"If cu_seqlens is passed in, then max_seqlen must be passed",
        ),
        (
            lambda: apply_rotary_emb(_t(2, 4, 1, 8), _t(5, 2), _t(5, 2), seqlen_offsets=torch.tensor([1, 2, 3])),
            r"seqlen_offsets must have shape \(batch_size,\) = \(2\)",
        ),
        (
            lambda: index_first_axis(torch.arange(4.0), torch.tensor([0])),
            r"index_first_axis: input must have at least 2 dims",
        ),
    ],
    ids=[
        "rotary-dim",
        "cos-sin-shapes",
        "seqlen-ro",
        "int-offset",
        "cu-without-max",
        "offsets-shape",
        "index-first-axis",
    ],
)
def test_helper_refusals(call, match):
    with pytest.raises(RuntimeError, match=match):
        call()


# ----------------------------------------------------------------------------- install()
_INSTALL_SCENARIOS = """
import importlib, json, os, sys

optional = sorted(m for m in ("einops", "triton", "flash_attn", "transformers") if m in sys.modules)
import subquad.compat.flash_attn as fa
optional += sorted(m for m in ("einops", "triton", "flash_attn", "transformers") if m in sys.modules)
root = os.getcwd()


def scenario(name, block=False):
    for m in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[m]
    sys.path[:] = [p for p in sys.path if not p.startswith(root)]
    if name != "missing":
        sys.path.insert(0, os.path.join(root, name))
    importlib.invalidate_caches()
    if block:
        sys.modules["flash_attn"] = None  # Python's way of saying "do not import it"
    first, second = fa.install(), fa.install()
    import flash_attn
    stray = sorted(m for m, mod in sys.modules.items() if m.startswith("flash_attn.") and mod is not None
                   and not mod.__name__.startswith("subquad."))
    return [first, second, flash_attn is fa, getattr(flash_attn, "REAL", False), stray]


results = {"optional imported": optional, "missing": scenario("missing")}
from flash_attn import flash_attn_func, flash_attn_with_kvcache
from flash_attn.flash_attn_interface import flash_attn_varlen_func
from flash_attn.bert_padding import pad_input, unpad_input
from flash_attn.layers.rotary import apply_rotary_emb
import flash_attn.bert_padding
results["names"] = [flash_attn_func is fa.flash_attn_func, flash_attn_varlen_func is fa.flash_attn_varlen_func,
                    flash_attn.bert_padding is fa.bert_padding, flash_attn.__version__]
for name in ("no-extension", "undefined-symbol", "oserror", "working"):
    results[name] = scenario(name)
results["blocked"] = scenario("working", block=True)
print(json.dumps(results))
"""

_FAKE_FLASH_ATTNS = {
    "no-extension": "import flash_attn_2_cuda",  # the CUDA extension is not built for this machine
    "undefined-symbol": "raise ImportError('libc10_cuda.so: undefined symbol: _ZN3c104cuda')",
    "oserror": "raise OSError('libcudart.so.12: cannot open shared object file')",
    "working": None,
}


def test_install(tmp_path):
    """In a fresh interpreter: stands in where flash-attn is missing or cannot import (its CUDA
    extension, an undefined symbol, a CUDA library), never shadows a working one, respects a
    blocked import, is idempotent, and importing the package pulls in no optional dependency."""
    for name, failure in _FAKE_FLASH_ATTNS.items():
        pkg = tmp_path / name / "flash_attn"
        pkg.mkdir(parents=True)
        if failure is None:
            (pkg / "__init__.py").write_text("REAL = True\ndef flash_attn_func(*args, **kwargs): return 'real'\n")
        else:
            # A submodule that imports before the failure: the failed attempt must not leave it behind.
            (pkg / "__init__.py").write_text(
                "from . import helpers\nfrom flash_attn.flash_attn_interface import flash_attn_func\n"
            )
            (pkg / "helpers.py").write_text("HELPER = 1\n")
            (pkg / "flash_attn_interface.py").write_text(f"import torch\n{failure}\n")
    done = subprocess.run(
        [sys.executable, "-c", _INSTALL_SCENARIOS],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
    )
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert results["optional imported"] == []
    assert results["missing"] == [True, True, True, False, []]
    assert results["names"] == [True, True, True, "2.8.3"]
    for name in ("no-extension", "undefined-symbol", "oserror"):
        assert results[name] == [True, True, True, False, []], name
    assert results["working"] == [False, False, False, True, []]
    assert results["blocked"] == [True, True, True, False, []]
