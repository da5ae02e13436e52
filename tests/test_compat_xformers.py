"""subquad.compat.xformers: xformers 0.0.35's ``memory_efficient_attention`` and ``attn_bias`` over subquad.

Every bias family is built at random (``make_case``) through the xformers API -- of the look-alike
module, or of real xformers where it imports -- and checked against a mask this file derives from
the constructor arguments alone (never from the package). Three tensors per check: a float64
golden, the same naive attention in the test dtype, and the code under test (``assert_close``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import subprocess
import sys
import textwrap
from typing import Any, ClassVar, List, Optional, Tuple

import pytest
import torch
from torch import Tensor

from subquad.compat.xformers import _install
from subquad.compat.xformers.ops import fmha

ab = fmha.attn_bias
H, K, KV = 2, 6, 5
INF = math.inf


# ----------------------------------------------------------------------------- references
def reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    keep: Optional[Tensor] = None,
    tensor: Optional[Tensor] = None,
    scale: Optional[float] = None,
    dtype: torch.dtype = torch.float64,
) -> Tuple[Tensor, Tensor]:
    """Naive attention in xformers' layout: ``out``, ``lse`` (rows that see nothing: 0, -inf)."""
    heads = query.dim() > 3
    q, k, v = (x.to(dtype).movedim(1, -2) if heads else x.to(dtype) for x in (query, key, value))
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else query.shape[-1] ** -0.5)
    if tensor is not None:
        s = s + tensor.to(dtype)
    if keep is not None:
        s = s.masked_fill(~keep, -INF)
    lse = s.logsumexp(-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    out = p @ v
    return (out.movedim(-2, 1) if heads else out), (lse if heads else lse.unsqueeze(1))


def assert_close(
    test: Tensor, golden: Tensor, naive: Tensor, what: str, fudge: float = 4.0, floor: float = 1e-12
) -> None:
    """``err(test) <= fudge * err(naive) + floor`` against the float64 golden; ``-inf`` where the golden has it."""
    assert test.shape == golden.shape, f"{what}: shape {tuple(test.shape)}, expected {tuple(golden.shape)}"
    inf = torch.isinf(golden)
    assert torch.equal(torch.isinf(test), inf), f"{what}: infinite at other places than the golden"
    t, g, n = test.double()[~inf], golden[~inf], naive.double()[~inf]
    if not g.numel():
        return
    err, err_naive = (t - g).abs(), (n - g).abs().max().item()
    worst = int(err.argmax())
    bound = fudge * err_naive + floor
    assert err[worst] <= bound, (
        f"{what}: error {err[worst].item():.3g} at flat index {worst} (test {t[worst].item():.6g}, golden "
        f"{g[worst].item():.6g}) exceeds {fudge} x naive error {err_naive:.3g} + {floor:g}"
    )


def additive(keep: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, -INF)


# ----------------------------------------------------------------------------- random valid biases
def sees(rule: str, i: int, j: int, lq: int, lk: int, w: Any = None) -> bool:
    """Whether query ``i`` sees key ``j`` of a block of ``lq`` queries and ``lk`` keys (the classes' docs)."""
    d = lk - lq
    if rule == "full":
        return True
    if rule == "causal":
        return j <= i
    if rule == "causal_br":
        return j <= i + d
    if rule == "local":
        return i - w < j <= i
    if rule == "local_br":
        return i + d - w < j <= i + d
    if rule == "band_br":
        return i + d - w[0] <= j <= i + d + w[1]
    raise AssertionError(rule)


@dataclasses.dataclass
class Case:
    bias: Any
    B: int
    Mq: int
    Mk: int  # key tensor length (physical, for paged)
    keep: Tensor  # (Mq, Mk) bool
    tensor: Optional[Tensor] = None  # (B, H, Mq, Mk) additive
    logical_Mk: Optional[int] = None  # what materialize takes for paged biases

    def inputs(self, dtype: torch.dtype, seed: int = 0, requires_grad: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
        g = torch.Generator().manual_seed(seed)
        shapes = ((self.B, self.Mq, H, K), (self.B, self.Mk, H, K), (self.B, self.Mk, H, KV))
        return tuple(
            torch.randn(s, generator=g, dtype=torch.float64).to(dtype).requires_grad_(requires_grad) for s in shapes
        )


def _keep_dense(rule: str, lq: int, lk: int, w: Any) -> Tensor:
    return torch.tensor(
        [[sees(rule, i, j, lq, lk, w) for j in range(lk)] for i in range(lq)], dtype=torch.bool
    ).reshape(lq, lk)


def _dense_case(ab: Any, family: str, r: random.Random, dtype: torch.dtype) -> Case:
    B, Mq, Mk = 2, r.randint(1, 9), r.randint(1, 11)
    g = torch.Generator().manual_seed(r.randint(0, 2**31))
    t = (torch.randn(B, H, Mq, Mk, generator=g, dtype=torch.float64) * 2).to(dtype)
    if family == "tensor":
        t[0, 0, 0, : max(1, Mk - 1)] = -INF  # a partly masked row
        return Case(t, B, Mq, Mk, _keep_dense("full", Mq, Mk, None), t)
    if family == "none":
        return Case(None, B, Mq, Mk, _keep_dense("full", Mq, Mk, None))
    if family == "LowerTriangularMask":
        return Case(ab.LowerTriangularMask(), B, Mq, Mk, _keep_dense("causal", Mq, Mk, None))
    if family == "LowerTriangularMaskWithTensorBias":
        bias = ab.LowerTriangularMask().add_bias(t) if r.random() < 0.5 else ab.LowerTriangularMaskWithTensorBias(t)
        return Case(bias, B, Mq, Mk, _keep_dense("causal", Mq, Mk, None), t)
    if family == "LowerTriangularFromBottomRightMask":
        return Case(ab.LowerTriangularFromBottomRightMask(), B, Mq, Mk, _keep_dense("causal_br", Mq, Mk, None))
    if family == "LowerTriangularFromBottomRightLocalAttentionMask":
        w = r.randint(1, 4)
        bias = (
            ab.LowerTriangularFromBottomRightMask().make_local_attention(w)
            if r.random() < 0.5
            else ab.LowerTriangularFromBottomRightLocalAttentionMask(w)
        )
        return Case(bias, B, Mq, Mk, _keep_dense("local_br", Mq, Mk, w))
    if family == "LocalAttentionFromBottomRightMask":
        w = (r.randint(0, 3), r.randint(0, 3))
        return Case(
            ab.LocalAttentionFromBottomRightMask(window_left=w[0], window_right=w[1]),
            B,
            Mq,
            Mk,
            _keep_dense("band_br", Mq, Mk, w),
        )
    raise AssertionError(family)


def _blocks_keep(q_lens: List[int], cols: List[List[int]], rule: str, w: Any, Mk: int) -> Tensor:
    """``cols[s][t]``: the key tensor position of block ``s``'s ``t``-th key."""
    keep = torch.zeros(sum(q_lens), Mk, dtype=torch.bool)
    qs = 0
    for lq, c in zip(q_lens, cols):
        for i in range(lq):
            for t, col in enumerate(c):
                keep[qs + i, col] |= sees(rule, i, t, lq, len(c), w)
        qs += lq
    return keep


BLOCK_RULES = {
    "BlockDiagonalMask": "full",
    "BlockDiagonalCausalMask": "causal",
    "BlockDiagonalCausalFromBottomRightMask": "causal_br",
    "BlockDiagonalCausalLocalAttentionMask": "local",
    "BlockDiagonalCausalLocalAttentionFromBottomRightMask": "local_br",
    "BlockDiagonalPaddedKeysMask": "full",
    "BlockDiagonalCausalWithOffsetPaddedKeysMask": "causal_br",
    "BlockDiagonalLocalAttentionPaddedKeysMask": "band_br",
    "BlockDiagonalCausalLocalAttentionPaddedKeysMask": "local_br",
    "PagedBlockDiagonalPaddedKeysMask": "full",
    "PagedBlockDiagonalCausalWithOffsetPaddedKeysMask": "causal_br",
    "BlockDiagonalGappyKeysMask": "full",
    "BlockDiagonalCausalWithOffsetGappyKeysMask": "causal_br",
    "PagedBlockDiagonalGappyKeysMask": "full",
    "PagedBlockDiagonalCausalWithOffsetGappyKeysMask": "causal_br",
}


def _consecutive_case(ab: Any, family: str, r: random.Random, n: int, q: List[int]) -> Case:
    rule = BLOCK_RULES[family]
    w = r.randint(1, 3) if "Local" in family else None
    if rule == "full":
        k = [r.randint(0, 5) for _ in range(n)]
    elif rule == "causal":
        k = [r.randint(1, 5) for _ in range(n)]
    elif rule == "local":
        k = [max(1, lq - w + 1) + r.randint(0, 2) for lq in q]
    else:
        k = [lq + r.randint(0, 3) for lq in q]
    base = ab.BlockDiagonalMask.from_seqlens(q, k)
    bias = {
        "BlockDiagonalMask": lambda: base,
        "BlockDiagonalCausalMask": base.make_causal,
        "BlockDiagonalCausalFromBottomRightMask": base.make_causal_from_bottomright,
        "BlockDiagonalCausalLocalAttentionMask": lambda: base.make_local_attention(w),
        "BlockDiagonalCausalLocalAttentionFromBottomRightMask": lambda: base.make_local_attention_from_bottomright(w),
    }[family]()
    starts = [sum(k[:s]) for s in range(n)]
    cols = [list(range(a, a + lk)) for a, lk in zip(starts, k)]
    return Case(bias, 1, sum(q), sum(k), _blocks_keep(q, cols, rule, w, sum(k)))


def _padded_case(ab: Any, family: str, r: random.Random, n: int, q: List[int]) -> Case:
    rule = BLOCK_RULES[family]
    P = max(q) + r.randint(0, 3)
    k = [r.randint(lq if rule != "full" else 0, P) for lq in q]
    w: Any = None
    if family == "BlockDiagonalPaddedKeysMask":
        bias = ab.BlockDiagonalPaddedKeysMask.from_seqlens(q, P, k)
    elif family == "BlockDiagonalCausalWithOffsetPaddedKeysMask":
        bias = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(q_seqlen=q, kv_padding=P, kv_seqlen=k)
    elif family == "BlockDiagonalLocalAttentionPaddedKeysMask":
        w = (r.randint(0, 3), r.randint(0, 3))
        bias = ab.BlockDiagonalLocalAttentionPaddedKeysMask.from_seqlens_local(q, P, k, w[0], w[1])
    else:
        w = r.randint(1, 3)
        bias = ab.BlockDiagonalCausalLocalAttentionPaddedKeysMask.from_seqlens_local(q, P, k, w)
    cols = [list(range(s * P, s * P + lk)) for s, lk in enumerate(k)]
    return Case(bias, 1, sum(q), n * P, _blocks_keep(q, cols, rule, w, n * P))


def _gappy_case(ab: Any, family: str, r: random.Random, n: int, q: List[int], tidy: bool) -> Case:
    rule = BLOCK_RULES[family]
    total = r.randint(max(q) + 1, 14)
    k, starts, at = [], [], 0
    for lq in q:
        lk = r.randint(lq if rule != "full" else 0, min(total, lq + 4))
        a = r.randint(0, total - lk)
        if tidy:  # ordered ranges with gaps: one packed call
            a = at + r.randint(0, 2)
            at = a + lk
        k.append(lk)
        starts.append(a)
    total = max(total, at)
    cls = getattr(ab, family)
    bias = cls.from_seqlens(q_seqlen=q, kv_seqstarts=starts + [total], kv_seqlen=k)
    cols = [list(range(a, a + lk)) for a, lk in zip(starts, k)]
    return Case(bias, 1, sum(q), total, _blocks_keep(q, cols, rule, None, total))


def _paged_case(ab: Any, family: str, r: random.Random, n: int, q: List[int]) -> Case:
    rule = BLOCK_RULES[family]
    ps, per_row = r.choice([1, 2, 3]), r.randint(1, 3)
    row = ps * per_row
    q = [min(lq, row) for lq in q]
    g = torch.Generator().manual_seed(r.randint(0, 2**31))
    tables = torch.randperm(n * per_row, generator=g).to(torch.int32).reshape(n, per_row)
    offsets = [0] * n
    if "Gappy" in family:
        offsets = [r.randint(0, row - (lq if rule != "full" else 1)) for lq in q]
        k = [r.randint(lq if rule != "full" else 0, row - off) for lq, off in zip(q, offsets)]
        unpaged = getattr(ab, family.replace("Paged", "")).from_seqlens(
            q_seqlen=q, kv_seqstarts=[s * row + off for s, off in enumerate(offsets)] + [n * row], kv_seqlen=k
        )
        bias = unpaged.make_paged(
            block_tables=tables, page_size=ps, notional_padding=row, paged_type=getattr(ab, family)
        )
    else:
        k = [r.randint(lq if rule != "full" else 0, row) for lq in q]
        if r.random() < 0.5:
            bias = getattr(ab, family).from_seqlens(q, k, tables, ps)
        else:
            unpaged = getattr(ab, family.replace("Paged", "")).from_seqlens(q, row, k)
            bias = unpaged.make_paged(tables, ps, getattr(ab, family))
    cols = [
        [int(tables[s, (off + t) // ps]) * ps + (off + t) % ps for t in range(lk)]
        for s, (off, lk) in enumerate(zip(offsets, k))
    ]
    Mk = n * per_row * ps
    return Case(bias, 1, sum(q), Mk, _blocks_keep(q, cols, rule, None, Mk), logical_Mk=n * row)


DENSE = [
    "none",
    "tensor",
    "LowerTriangularMask",
    "LowerTriangularMaskWithTensorBias",
    "LowerTriangularFromBottomRightMask",
    "LowerTriangularFromBottomRightLocalAttentionMask",
    "LocalAttentionFromBottomRightMask",
]
FAMILIES = DENSE + list(BLOCK_RULES) + ["BlockDiagonalGappyKeysMask-tidy"]


def make_case(ab: Any, family: str, seed: int, dtype: torch.dtype = torch.float64) -> Case:
    """A random valid instance of ``family``, built with the API of the bias module ``ab``."""
    r = random.Random(f"{family}-{seed}")
    if family in DENSE:
        return _dense_case(ab, family, r, dtype)
    n = r.randint(1, 4)
    q = [r.randint(1, 5) for _ in range(n)]
    if family.startswith("Paged"):
        return _paged_case(ab, family, r, n, q)
    if "Gappy" in family:
        return _gappy_case(ab, family.replace("-tidy", ""), r, n, q, tidy=family.endswith("-tidy"))
    if "Padded" in family:
        return _padded_case(ab, family, r, n, q)
    return _consecutive_case(ab, family, r, n, q)


# ----------------------------------------------------------------------------- every family, look-alikes
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_materialize_is_the_documented_mask(family, seed):
    case = make_case(ab, family, seed)
    if case.bias is None or isinstance(case.bias, Tensor):
        return
    expected = additive(case.keep, torch.float64)
    if case.tensor is not None:  # the tensor (float64 here) is added as it is
        expected = expected + case.tensor
    shape = (case.B, H, case.Mq, case.logical_Mk or case.Mk)
    got = case.bias.materialize(shape, dtype=torch.float32)
    assert got.dtype == (torch.float32 if case.tensor is None else torch.float64)
    assert torch.equal(got.double(), expected.expand(case.B, H, case.Mq, case.Mk)), family


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_forward_and_lse_match_the_golden(family, seed):
    for dtype in (torch.float64, torch.float32) if seed == 0 else (torch.float64,):
        case = make_case(ab, family, seed, dtype)
        q, k, v = case.inputs(dtype, seed)
        out, lse = fmha.memory_efficient_attention_forward_requires_grad(q, k, v, case.bias)
        golden = reference(q, k, v, case.keep, case.tensor)
        naive = reference(q, k, v, case.keep, case.tensor, dtype=dtype)
        assert out.dtype == dtype and lse.dtype in (torch.float32, torch.float64)
        assert_close(out, golden[0], naive[0], f"{family} out {dtype}", floor=1e-12 if dtype == torch.float64 else 1e-6)
        assert_close(lse, golden[1], naive[1], f"{family} lse {dtype}", floor=1e-12 if dtype == torch.float64 else 1e-6)
        if dtype == torch.float64:
            assert torch.allclose(fmha.memory_efficient_attention(q, k, v, case.bias), out, rtol=0, atol=1e-13)


@pytest.mark.parametrize(
    "family",
    [
        "tensor",
        "LowerTriangularMaskWithTensorBias",
        "LocalAttentionFromBottomRightMask",
        "BlockDiagonalCausalFromBottomRightMask",
        "BlockDiagonalGappyKeysMask",
        "PagedBlockDiagonalCausalWithOffsetPaddedKeysMask",
        "BlockDiagonalCausalLocalAttentionPaddedKeysMask",
    ],
)
def test_gradients_match_the_golden(family):
    case = make_case(ab, family, 1)
    q, k, v = case.inputs(torch.float64, 1, requires_grad=True)
    bias = case.bias
    if case.tensor is not None:
        case.tensor.requires_grad_(True)
    grad = torch.randn(case.B, case.Mq, H, KV, dtype=torch.float64)
    out = fmha.memory_efficient_attention(q, k, v, bias)
    leaves = [q, k, v] + ([case.tensor] if case.tensor is not None else [])
    got = torch.autograd.grad(out, leaves, grad)
    ref = torch.autograd.grad(reference(q, k, v, case.keep, case.tensor)[0], leaves, grad)
    for name, a, b in zip(["dq", "dk", "dv", "dbias"], got, ref):
        assert torch.allclose(a, b, rtol=0, atol=1e-11), f"{family} {name}: {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("none", "tensor")])
def test_attention_never_materializes_the_bias(family, monkeypatch):
    case = make_case(ab, family, 0, torch.float32)

    def refuse(*args, **kwargs):
        raise AssertionError("attention materialized its bias")

    monkeypatch.setattr(type(case.bias), "materialize", refuse)
    q, k, v = case.inputs(torch.float32)
    fmha.memory_efficient_attention(q, k, v, case.bias)


def test_gappy_runs_and_paged_gathers_split_as_documented():
    # overlapping and backwards key ranges: three packed calls, views of the key tensor
    from subquad.compat.xformers.ops.fmha import _attend, _reading

    bias = ab.BlockDiagonalGappyKeysMask.from_seqlens([1, 2, 1, 2], [0, 3, 1, 6, 9], [3, 2, 4, 3])
    assert _attend._runs(_reading.read_bias(bias)) == [(0, 2), (2, 4)]
    bias = ab.BlockDiagonalGappyKeysMask.from_seqlens([1, 1, 1], [5, 2, 0, 9], [1, 1, 1])
    assert _attend._runs(_reading.read_bias(bias)) == [(0, 1), (1, 2), (2, 3)]


# ----------------------------------------------------------------------------- layouts, options
def test_bmk_layout_and_its_lse():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((3, 7, 8), (3, 9, 8), (3, 9, 4)))
    t = torch.randn(3, 7, 9, generator=g, dtype=torch.float64)
    for bias, keep, tensor in (
        (None, None, None),
        (ab.LowerTriangularMask(), _keep_dense("causal", 7, 9, None), None),
        (t, None, t),
    ):
        out, lse = fmha.memory_efficient_attention_forward_requires_grad(q, k, v, bias)
        golden = reference(q, k, v, keep, tensor)
        assert out.shape == (3, 7, 4) and lse.shape == (3, 1, 7)
        assert torch.allclose(out, golden[0], atol=1e-12) and torch.allclose(lse, golden[1], atol=1e-12)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_bmghk_with_expanded_heads_is_gqa(requires_grad):
    g = torch.Generator().manual_seed(4)
    B, M, G, Hg = 2, 6, 2, 3
    q = torch.randn(B, M, G, Hg, K, generator=g, dtype=torch.float64)
    k1 = torch.randn(B, M + 2, G, 1, K, generator=g, dtype=torch.float64).requires_grad_(requires_grad)
    v1 = torch.randn(B, M + 2, G, 1, KV, generator=g, dtype=torch.float64).requires_grad_(requires_grad)
    k, v = k1.expand(-1, -1, -1, Hg, -1), v1.expand(-1, -1, -1, Hg, -1)
    t = torch.randn(B, G, Hg, M, M + 2, generator=g, dtype=torch.float64)
    keep = _keep_dense("causal", M, M + 2, None)
    out, lse = fmha.memory_efficient_attention_forward_requires_grad(q, k, v, ab.LowerTriangularMaskWithTensorBias(t))
    golden = reference(q, k.contiguous(), v.contiguous(), keep, t)
    assert out.shape == (B, M, G, Hg, KV) and lse.shape == (B, G, Hg, M)
    assert torch.allclose(out, golden[0], atol=1e-12) and torch.allclose(lse, golden[1], atol=1e-12)
    if requires_grad:
        grads = torch.autograd.grad(out.sum(), (k1, v1))
        ref = torch.autograd.grad(golden[0].sum(), (k1, v1))
        assert all(torch.allclose(a, b, atol=1e-11) for a, b in zip(grads, ref))
    # block-diagonal with groups: batch 1, lse (1, G, H, T)
    bias = ab.BlockDiagonalCausalMask.from_seqlens([2, 4], [3, 5])
    qb = q[:1]
    kb, vb = k[:1], v[:1]
    out, lse = fmha.memory_efficient_attention_forward_requires_grad(qb, kb, vb, bias)
    keep = _blocks_keep([2, 4], [[0, 1, 2], [3, 4, 5, 6, 7]], "causal", None, 8)
    golden = reference(qb, kb.contiguous(), vb.contiguous(), keep)
    assert out.shape == (1, M, G, Hg, KV) and lse.shape == (1, G, Hg, M)
    assert torch.allclose(out, golden[0], atol=1e-12) and torch.allclose(lse, golden[1], atol=1e-12)


@pytest.mark.parametrize(
    "family",
    [
        "LowerTriangularFromBottomRightMask",
        "BlockDiagonalCausalWithOffsetPaddedKeysMask",
        "BlockDiagonalGappyKeysMask",
        "PagedBlockDiagonalPaddedKeysMask",
    ],
)
def test_bmhk_with_one_expanded_kv_head_is_mqa(family):
    case = make_case(ab, family, 2)
    q, k, v = case.inputs(torch.float64, 2)
    k, v = k[:, :, :1].expand(-1, -1, H, -1), v[:, :, :1].expand(-1, -1, H, -1)
    out = fmha.memory_efficient_attention(q, k, v, case.bias)
    golden = reference(q, k.contiguous(), v.contiguous(), case.keep, case.tensor)[0]
    assert torch.allclose(out, golden, rtol=0, atol=1e-12)


def test_scale_output_dtype_and_op_are_honoured():
    case = make_case(ab, "BlockDiagonalCausalMask", 0)
    q, k, v = case.inputs(torch.float64)
    out = fmha.memory_efficient_attention(
        q, k, v, case.bias, scale=0.3, output_dtype=torch.float32, op=fmha.MemoryEfficientAttentionFlashAttentionOp
    )
    assert out.dtype == torch.float32 and out.is_contiguous()
    assert torch.allclose(out.double(), reference(q, k, v, case.keep, scale=0.3)[0], atol=1e-6)
    same = fmha.memory_efficient_attention(q, k, v, case.bias, scale=0.3, op=(object, None))
    assert torch.allclose(out.double(), same, atol=1e-6)


def test_dropout():
    case = make_case(ab, "LowerTriangularMask", 0)
    q, k, v = case.inputs(torch.float32)
    assert torch.count_nonzero(fmha.memory_efficient_attention(q, k, v, case.bias, p=1.0)) == 0
    torch.manual_seed(0)
    a = fmha.memory_efficient_attention(q, k, v, case.bias, p=0.5)
    torch.manual_seed(0)
    b = fmha.memory_efficient_attention(q, k, v, case.bias, p=0.5)
    assert torch.equal(a, b) and not torch.allclose(a, fmha.memory_efficient_attention(q, k, v, case.bias))
    blocks = make_case(ab, "BlockDiagonalGappyKeysMask", 1)
    bq, bk, bv = blocks.inputs(torch.float32)
    assert torch.count_nonzero(fmha.memory_efficient_attention(bq, bk, bv, blocks.bias, p=1.0)) == 0
    for fn in (fmha.memory_efficient_attention_forward_requires_grad, fmha.memory_efficient_attention_partial):
        with pytest.raises(NotImplementedError, match="dropout is not supported"):
            fn(q, k, v, p=0.1)
    with pytest.raises(NotImplementedError, match="dropout is not supported on the non-autograd API"):
        fmha.memory_efficient_attention_backward(q, q, torch.zeros(case.B, H, case.Mq), q, k, v, p=0.1)


@pytest.mark.parametrize(
    "family", ["tensor", "BlockDiagonalCausalWithOffsetPaddedKeysMask", "LocalAttentionFromBottomRightMask"]
)
def test_backward_api_equals_autograd(family):
    case = make_case(ab, family, 2)
    q, k, v = case.inputs(torch.float64, 2, requires_grad=True)
    out, lse = fmha.memory_efficient_attention_forward_requires_grad(q, k, v, case.bias)
    grad = torch.randn_like(out)
    dq, dk, dv = fmha.memory_efficient_attention_backward(grad, out, lse, q, k, v, case.bias)
    ref = torch.autograd.grad(reference(q, k, v, case.keep, case.tensor)[0], (q, k, v), grad)
    assert all(torch.allclose(a, b, atol=1e-11) for a, b in zip((dq, dk, dv), ref))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


# ----------------------------------------------------------------------------- partial and merge
@pytest.mark.parametrize("groups", [False, True])
def test_partial_chunks_merge_into_full_attention(groups):
    g = torch.Generator().manual_seed(5)
    shape = (2, 7, 2, 2) if groups else (2, 7, 3)
    q = torch.randn(*shape, K, generator=g, dtype=torch.float64)
    k = torch.randn(2, 11, *shape[2:], K, generator=g, dtype=torch.float64)
    v = torch.randn(2, 11, *shape[2:], KV, generator=g, dtype=torch.float64)
    bias = ab.LowerTriangularMask()  # the second chunk is invisible to the first rows: lse -inf there
    outs, lses = zip(
        *(
            fmha.memory_efficient_attention_partial(q, k[:, a:b], v[:, a:b], bias if a == 0 else None)
            for a, b in ((0, 4), (4, 11))
        )
    )
    full_keep = torch.ones(7, 11, dtype=torch.bool)
    full_keep[:, :4] = _keep_dense("causal", 7, 4, None)
    golden = reference(q, k, v, full_keep)
    for out, lse in (
        fmha.merge_attentions(list(outs), list(lses)),
        fmha.merge_attentions(torch.stack(outs), torch.stack(lses)),
    ):
        assert torch.allclose(out, golden[0], atol=1e-12) and torch.allclose(lse, golden[1], atol=1e-12)
    out, lse = fmha.merge_attentions(list(outs), list(lses), write_lse=False, output_dtype=torch.float32)
    assert lse is None and out.dtype == torch.float32


def test_partial_output_is_float32_and_empty_rows_weigh_nothing():
    q = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    out, lse = fmha.memory_efficient_attention_partial(q, q, q, ab.LowerTriangularFromBottomRightMask())
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    kv = torch.randn(1, 2, 2, 8, dtype=torch.bfloat16)
    out, lse = fmha.memory_efficient_attention_partial(q, kv, kv, ab.LowerTriangularFromBottomRightMask())
    assert torch.all(lse[:, :, :2] == -INF) and torch.count_nonzero(out[:, :2]) == 0
    merged, mlse = fmha.merge_attentions([out, torch.zeros_like(out)], [lse, torch.full_like(lse, -INF)])
    assert torch.equal(merged, out) and torch.equal(mlse, lse)


def test_merge_is_differentiable():
    g = torch.Generator().manual_seed(6)
    outs = [torch.randn(2, 5, 3, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    lses = [torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    out, lse = fmha.merge_attentions(outs, lses)
    w = torch.softmax(torch.stack(lses), 0)
    ref_out = (w.permute(0, 1, 3, 2).unsqueeze(-1) * torch.stack(outs)).sum(0)
    ref_lse = torch.logsumexp(torch.stack(lses), 0)
    got = torch.autograd.grad((out.sum() + lse.sum()), outs + lses)
    ref = torch.autograd.grad((ref_out.sum() + ref_lse.sum()), outs + lses)
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(got, ref))
    with pytest.raises(ValueError, match="write_lse should be true if inputs require gradients"):
        fmha.merge_attentions(outs, lses, write_lse=False)


# ----------------------------------------------------------------------------- xformers' own CPU bias tests, restated
def test_causal_and_tensor_bias_materialize():
    m = -INF
    assert torch.equal(ab.LowerTriangularMask().materialize((3, 2)), torch.tensor([[0, m], [0, 0], [0, 0]]))
    t = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    assert torch.equal(
        ab.LowerTriangularMask().add_bias(t).materialize((3, 2)), t + torch.tensor([[0, m], [0, 0], [0, 0]])
    )
    t = torch.tensor([[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]])
    assert torch.equal(
        ab.LowerTriangularMaskWithTensorBias(t).materialize((2, 3)), t + torch.tensor([[0, m, m], [0, 0, m]])
    )


@pytest.mark.parametrize("batches", [[1, 1, 1], [1, 3, 1]])
def test_block_diagonal_from_tensor_list_and_split(batches):
    xs = [torch.randn(b, n, 1, 8) for b, n in zip(batches, [3, 2, 5])]
    bias, packed = ab.BlockDiagonalMask.from_tensor_list(xs)
    total = sum(b * n for b, n in zip(batches, [3, 2, 5]))
    mask = bias.materialize((total, total))
    assert int((mask != -INF).sum()) == sum(b * n * n for b, n in zip(batches, [3, 2, 5]))
    assert torch.equal(mask[:3, :3], torch.zeros(3, 3)) and torch.equal(mask[-5:, -5:], torch.zeros(5, 5))
    assert all(torch.equal(a, b) for a, b in zip(xs, bias.split(packed)))
    q = packed.expand(1, total, H, 8)
    out = fmha.memory_efficient_attention(q, q, q, bias)
    assert [tuple(o.shape) for o in bias.split(out)] == [(b, n, H, 8) for b, n in zip(batches, [3, 2, 5])]


def test_cross_attention_blocks_and_causal():
    list_q = [torch.randn(1, 3, 1, 8), torch.randn(2, 1, 1, 8)]
    list_k = [torch.randn(1, 2, 1, 8), torch.randn(2, 3, 1, 8)]
    bias, q, k, _ = ab.BlockDiagonalMask.from_tensor_lists_qkv(list_q, list_k)
    mask = bias.materialize((q.shape[1], k.shape[1]))
    assert int((mask != -INF).sum()) == 3 * 2 + 2 * 3 * 1
    assert torch.equal(mask[3:4, 2:5], torch.zeros(1, 3)) and torch.equal(mask[4:, 5:], torch.zeros(1, 3))
    causal = bias.make_causal().materialize((q.shape[1], k.shape[1]))
    assert torch.equal(causal[3:4, 2:5], ab.LowerTriangularMask().materialize((1, 3)))
    assert all(torch.equal(a, b) for a, b in zip(list_q, bias.split_queries(q)))
    assert all(torch.equal(a, b) for a, b in zip(list_k, bias.split_kv(k)))
    with pytest.raises(ValueError, match="expected format"):
        bias.split_queries(k)


def test_cross_attention_causal_with_a_prefix():
    bias, q, k, _ = ab.BlockDiagonalMask.from_tensor_lists_qkv([torch.randn(1, 3, 1, 8)], [torch.randn(1, 2, 1, 8)])
    with pytest.raises(ValueError, match=r"Block #0 has num_keys=2 and num_queries=3"):
        bias.make_causal_from_bottomright()
    bias, q, k, _ = ab.BlockDiagonalMask.from_tensor_lists_qkv(
        [torch.randn(1, 2, 1, 8), torch.randn(2, 2, 1, 8)], [torch.randn(1, 2, 1, 8), torch.randn(2, 5, 1, 8)]
    )
    mask = bias.make_causal_from_bottomright().materialize((q.shape[1], k.shape[1]))
    m = -INF
    assert torch.equal(mask[0:2, 0:2], torch.tensor([[0, m], [0, 0]]))
    for rows, cols in ((slice(2, 4), slice(2, 7)), (slice(4, 6), slice(7, 12))):
        assert torch.equal(mask[rows, cols], torch.tensor([[0, 0, 0, 0, m], [0, 0, 0, 0, 0]]))


def test_from_seqlens_split_and_window_materialize():
    out = ab.BlockDiagonalMask.from_seqlens([3, 5, 1]).split(torch.randn(1, 9, 16))
    assert [tuple(o.shape) for o in out] == [(1, 3, 16), (1, 5, 16), (1, 1, 16)]
    assert ab.BlockDiagonalMask.from_seqlens(list(torch.tensor([3, 5, 1]).numpy())).q_seqinfo.seqstart_py == [
        0,
        3,
        8,
        9,
    ]
    with pytest.raises(ValueError, match="a Python list, not a tensor"):
        ab.BlockDiagonalMask.from_seqlens(torch.tensor([3, 5]))
    mask = ab.BlockDiagonalMask.from_seqlens([4, 6], [4, 6]).make_local_attention(2).materialize((1, 1, 10, 10))
    keep = torch.zeros(10, 10, dtype=torch.bool)
    for i in range(10):
        first = 0 if i < 4 else 4
        keep[i, max(first, i - 1) : i + 1] = True
    assert torch.equal(mask, additive(keep).view(1, 1, 10, 10))


def test_all_ones_queries_average_the_values():
    for b, mq, mkv in ((1, 128, 512), (4, 512, 128)):
        q, k = torch.ones(b, mq, 6), torch.ones(b, mkv, 6)
        v = torch.randn(b, mkv, 6) * 3
        out = fmha.memory_efficient_attention(q, k, v)
        assert torch.allclose(out, v.mean(1, keepdim=True).expand_as(q), atol=1e-5)


# ----------------------------------------------------------------------------- refusals
def test_refusals_of_the_call():
    q = torch.randn(1, 4, 2, 8)
    mha = fmha.memory_efficient_attention
    with pytest.raises(ValueError, match="should all have BMGHK, BMHK or BMK shape"):
        mha(q, q[0], q)
    with pytest.raises(ValueError, match="should all be on the same device"):
        mha(q, q.to("meta"), q)
    with pytest.raises(ValueError, match="should either all have the same dtype"):
        mha(q, q.double(), q)
    with pytest.raises(NotImplementedError, match="Quantized"):
        mha(q, q.int(), q.int())
    with pytest.raises(
        ValueError,
        match="Please provide inputs in BMHK format rather than BMK when using bias type `BlockDiagonalMask`",
    ):
        mha(q[:, :, 0], q[:, :, 0], q[:, :, 0], ab.BlockDiagonalMask.from_seqlens([4]))
    with pytest.raises(
        ValueError, match=r"Invalid shape for attention bias: torch.Size\(\[1, 4, 4\]\) \(expected \(1, 2, 4, 4\)\)"
    ):
        mha(q, q, q, torch.zeros(1, 4, 4))
    with pytest.raises(ValueError, match=r"Expected attn_bias.dtype == query.dtype"):
        mha(q, q, q, torch.zeros(1, 2, 4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="Expected batch_size=1 when using block-diagonal bias"):
        mha(
            q.expand(2, -1, -1, -1),
            q.expand(2, -1, -1, -1),
            q.expand(2, -1, -1, -1),
            ab.BlockDiagonalMask.from_seqlens([4]),
        )
    with pytest.raises(ValueError, match=r"Invalid dropout probability: p=1.5"):
        mha(q, q, q, p=1.5)
    with pytest.raises(ValueError, match="HINT: We don't support broadcasting"):
        mha(q, q[:, :, :1], q)
    with pytest.raises(ValueError, match=r"describes 5 queries in 2 blocks, but query.shape\[1\] = 4"):
        mha(q, q, q, ab.BlockDiagonalMask.from_seqlens([2, 3], [2, 2]))
    with pytest.raises(ValueError, match=r"was built for 5 keys, but key.shape\[1\] = 4"):
        mha(q, q, q, ab.BlockDiagonalMask.from_seqlens([2, 2], [2, 3]))
    with pytest.raises(NotImplementedError, match=r"attn_bias of type .*Mystery is not one subquad knows"):
        mha(q, q, q, type("Mystery", (), {})())
    with pytest.raises(TypeError, match="Expected scale to be None or a float"):
        mha(q, q, q, scale="0.1")
    paged = ab.PagedBlockDiagonalPaddedKeysMask.from_seqlens(
        [2, 2], [1, 2], torch.tensor([[0], [5]], dtype=torch.int32), 2
    )
    with pytest.raises(ValueError, match=r"names pages 0..5, but key holds 2 pages of 2"):
        mha(q, q, q, paged)
    paged = ab.PagedBlockDiagonalPaddedKeysMask.from_seqlens(
        [2, 2], [1, 2], torch.tensor([[0], [1]], dtype=torch.int32), 3
    )
    with pytest.raises(ValueError, match=r"to be whole pages of page_size=3"):
        mha(q, q, q, paged)


def test_refusals_of_the_backward_and_merge():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="All tensors should be either in BMK"):
        fmha.memory_efficient_attention_backward(q[0], q, torch.zeros(1, 2, 4), q, q, q)
    with pytest.raises(ValueError, match="Input tensors have incompatible shapes"):
        fmha.memory_efficient_attention_backward(q, q, torch.zeros(1, 4, 2), q, q, q)
    o, lse = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 4)
    with pytest.raises(ValueError, match="Incompatible number of LSE and attention chunks"):
        fmha.merge_attentions([o, o], [lse])
    with pytest.raises(ValueError, match="Incompatible input shapes for chunk 0"):
        fmha.merge_attentions([o], [lse[0]])
    with pytest.raises(ValueError, match="Incompatible input shapes for LSE chunk 1"):
        fmha.merge_attentions([o, o], [lse, lse[:, :, :3]])
    with pytest.raises(ValueError, match="Incompatible input shapes for attention chunk 1"):
        fmha.merge_attentions([o, o[:, :3]], [lse, lse])
    with pytest.raises(ValueError, match=r"Incompatible input shapes: attn_split\.shape"):
        fmha.merge_attentions(torch.stack([o]), torch.stack([o]))


def test_refusals_of_the_bias_constructors():
    with pytest.raises(ValueError, match="expected `window_left >= 0` but got window_left=-1"):
        ab.LocalAttentionFromBottomRightMask(-1, 0)
    with pytest.raises(ValueError, match=r"Expected `window_size > 0`, but window_size=0"):
        ab.LowerTriangularFromBottomRightMask().make_local_attention(0)
    with pytest.raises(ValueError, match=r"Expected `window_size > 0`, but window_size=0"):
        ab.BlockDiagonalCausalLocalAttentionMask.from_seqlens([2])
    with pytest.raises(RuntimeError, match="No keys are attended in q_seqlen 5 k_seqlen 2 with sliding window 3"):
        ab.BlockDiagonalMask.from_seqlens([5], [2]).make_local_attention(3)
    with pytest.raises(ValueError, match="Block #1 has num_keys=1 and num_queries=2"):
        ab.BlockDiagonalMask.from_seqlens([1, 2], [1, 1]).make_local_attention_from_bottomright(2)
    with pytest.raises(ValueError, match="No elements"):
        ab.BlockDiagonalGappyKeysMask.from_seqlens([], [0], [])
    with pytest.raises(ValueError, match="should be len"):
        ab.BlockDiagonalGappyKeysMask.from_seqlens([1, 1], [0, 2], [1, 1])
    gappy = ab.BlockDiagonalGappyKeysMask.from_seqlens([1], [0, 4], [2])
    with pytest.raises(ValueError, match="Notional padding should be divisible by the page size"):
        gappy.make_paged(torch.zeros(1, 2, dtype=torch.int32), 2, 3, ab.PagedBlockDiagonalGappyKeysMask)
    with pytest.raises(ValueError, match=r"Expected every seqlen <= padding"):
        ab.BlockDiagonalPaddedKeysMask.from_seqlens([1], 2, [3])
    with pytest.raises(ValueError, match="Expected as many kv_seqlen as q_seqlen"):
        ab.BlockDiagonalMask.from_seqlens([1, 2], [1])
    with pytest.raises(ValueError, match="q shapes wrong"):
        ab.BlockDiagonalMask.from_seqlens([1, 2]).materialize((4, 3))
    with pytest.raises(ValueError, match="k shapes wrong"):
        ab.BlockDiagonalMask.from_seqlens([1, 2]).materialize((3, 4))
    with pytest.raises(ValueError, match="share blocks; use split_queries"):
        ab.BlockDiagonalMask.from_seqlens([1, 2], [2, 2]).split(torch.zeros(1, 3, 4))


def test_paged_gappy_from_seqlens_takes_one_start_per_block():
    # xformers 0.0.35's own from_seqlens refuses these arguments (its length check is for the unpaged case).
    tables = torch.tensor([[1, 0], [3, 2]], dtype=torch.int32)
    direct = ab.PagedBlockDiagonalGappyKeysMask.from_seqlens([2, 3], [1, 1], [3, 4], tables, 4)
    via = ab.BlockDiagonalGappyKeysMask.from_seqlens([2, 3], [1, 9, 16], [3, 4]).make_paged(
        tables, 4, 8, ab.PagedBlockDiagonalGappyKeysMask
    )
    assert direct.k_seqinfo.seqstart_py == via.k_seqinfo.seqstart_py == [1, 1, -1]
    assert torch.equal(direct.materialize((5, 16)), via.materialize((5, 16)))


# ----------------------------------------------------------------------------- real xformers objects
@pytest.fixture(scope="module")
def real_ab():
    real = pytest.importorskip(
        "xformers.ops.fmha", reason="xformers is not installed (pip install --no-deps xformers==0.0.35)"
    )
    return real.attn_bias


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("none", "tensor")])
def test_real_xformers_objects_run_as_the_look_alikes(real_ab, family):
    ours, theirs = make_case(ab, family, 1), make_case(real_ab, family, 1)
    assert (
        type(theirs.bias).__module__.startswith("xformers") and type(theirs.bias).__name__ == type(ours.bias).__name__
    )
    shape = (ours.B, H, ours.Mq, ours.logical_Mk or ours.Mk)
    assert torch.equal(theirs.bias.materialize(shape), ours.bias.materialize(shape))
    q, k, v = ours.inputs(torch.float64, 1)
    a = fmha.memory_efficient_attention_forward_requires_grad(q, k, v, ours.bias)
    b = fmha.memory_efficient_attention_forward_requires_grad(q, k, v, theirs.bias)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_real_xformers_tensor_bias_shapes_agree(real_ab):
    import xformers.ops.fmha as real

    q = torch.zeros(1, 4, 2, 8)
    for bias in (torch.zeros(1, 4, 4), torch.zeros(2, 2, 4, 4)):
        for fn in (real.memory_efficient_attention, fmha.memory_efficient_attention):
            with pytest.raises(ValueError, match="Invalid shape for attention bias"):
                fn(q, q, q, bias)


# ----------------------------------------------------------------------------- install()
def _run(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_install_where_xformers_is_missing():
    out = _run("""
        import sys
        import subquad, subquad.compat.xformers as sx
        from subquad.compat.xformers.ops import fmha
        assert "xformers" not in sys.modules  # never imported at subquad import time
        sys.modules["xformers"] = None  # hide it, as on a machine without it
        done = sx.install()
        assert done.mode == "stand-in" and sx.install() is done, done
        import torch
        import xformers, xformers.ops as xops
        from xformers.ops import LowerTriangularMask, memory_efficient_attention, fmha as xfmha
        from xformers.ops.fmha.attn_bias import BlockDiagonalCausalMask
        assert xops is sx.ops and xfmha is fmha and memory_efficient_attention is fmha.memory_efficient_attention
        q = torch.randn(1, 5, 2, 8)
        out = xops.memory_efficient_attention(q, q, q, attn_bias=BlockDiagonalCausalMask.from_seqlens([2, 3]))
        out = xops.memory_efficient_attention(q, q, q, attn_bias=LowerTriangularMask())
        print(done.mode, xformers.__version__, tuple(out.shape))
    """)
    assert "stand-in 0.0.35+subquad (1, 5, 2, 8)" in out


def test_install_where_xformers_has_no_operator():
    pytest.importorskip("xformers.ops", reason="xformers is not installed (pip install --no-deps xformers==0.0.35)")
    out = _run("""
        import sys, warnings
        warnings.simplefilter("ignore")
        import torch
        import subquad.compat.xformers as sx
        done = sx.install()
        assert done.mode == "fallback" and sx.install() is done, done
        assert "xformers.ops.memory_efficient_attention" in done.names and "xformers.ops.fmha.merge_attentions" in done.names
        import xformers.ops as xops
        from xformers.ops import fmha
        assert "subquad" not in xops.__file__
        q = torch.randn(1, 6, 2, 8)
        bias = fmha.attn_bias.BlockDiagonalCausalMask.from_seqlens([2, 4])
        out = xops.memory_efficient_attention(q, q, q, attn_bias=bias)
        assert torch.equal(out, sx.ops.memory_efficient_attention(q, q, q, attn_bias=bias))
        out = fmha.memory_efficient_attention(q, q, q, op=fmha.MemoryEfficientAttentionFlashAttentionOp)
        g = q.clone().requires_grad_(True)
        xops.memory_efficient_attention(g, g, g, bias).sum().backward()
        assert g.grad is not None
        o, lse = fmha.memory_efficient_attention_partial(q, q, q)
        merged, _ = fmha.merge_attentions([o, o], [lse, lse])
        assert torch.allclose(merged, o)
        try:  # xformers' own validation still answers first
            xops.memory_efficient_attention(q, q[:, :, :1], q)
        except ValueError as e:
            assert "Incompatible shapes" in str(e)
        else:
            raise AssertionError("no ValueError")
        print("fallback ok")
    """)
    assert "fallback ok" in out


def test_fallback_asks_xformers_first():
    calls: List[str] = []

    def has_operator(*args, **kwargs):
        calls.append("xformers")
        return "from xformers"

    def no_operator(*args, **kwargs):
        raise NotImplementedError("No operator found for `memory_efficient_attention_forward` with inputs: ...")

    def other_refusal(*args, **kwargs):
        raise NotImplementedError("something else")

    def ours(*args, **kwargs):
        return "from subquad"

    q = torch.zeros(1)
    assert _install._wrap(has_operator, ours, merge=False)(q) == "from xformers" and calls == ["xformers"]
    assert _install._wrap(no_operator, ours, merge=False)(q) == "from subquad"
    with pytest.raises(NotImplementedError, match="something else"):
        _install._wrap(other_refusal, ours, merge=False)(q)
    assert _install._wrap(other_refusal, ours, merge=True)(q) == "from subquad"

    class CudaOnly:
        SUPPORTED_DEVICES: ClassVar[set[str]] = {"cuda"}

    assert _install._wrap(has_operator, ours, merge=False)(q, op=(CudaOnly, None)) == "from subquad"
    assert calls == ["xformers"]
