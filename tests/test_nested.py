"""Jagged nested tensors through subquad.sdpa / subquad.attention (as SDPA takes them: (B, H, j, E)).

Where torch runs (its math path: no causal, no mask) the result must equal torch's; where torch
refuses (``is_causal=True``: "No viable backend"; any mask: "Masks are not yet supported!") it must
equal SDPA run on each sequence alone. Gradients flow to the nested inputs.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import subquad
from conftest import assert_close_to_golden
from subquad.integrations.patch import ORIGINAL_SDPA

f64 = torch.float64


def nested(lengths, H=2, E=8, dtype=f64, seed=0, grad=True):
    """A jagged nested tensor (B, H, j, E), and its sequences as (H, L, E) tensors."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(n, H, E, generator=g, dtype=dtype) for n in lengths]
    nt = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=grad).transpose(1, 2)
    return nt, [p.transpose(0, 1) for p in parts]


def per_sequence(qs, ks, vs, **kw):
    return [ORIGINAL_SDPA(q, k, v, **kw) for q, k, v in zip(qs, ks, vs)]


def grads_of(nts, out):
    g = [torch.randn_like(o) for o in out.unbind()]
    loss = sum((o * gi).sum() for o, gi in zip(out.unbind(), g))
    return [t.unbind() for t in torch.autograd.grad(loss, nts)], g


@pytest.mark.parametrize("lengths", [[3, 5], [1, 7, 4], [9]], ids=["two", "three", "one"])
def test_equals_torchs_math_path_where_torch_runs(lengths):
    (q, _qs), (k, _ks), (v, _vs) = (nested(lengths, seed=s) for s in range(3))
    out = subquad.sdpa(q, k, v)
    assert out.is_nested and out.shape[:2] == q.shape[:2]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(q2, k2, v2)
    for a, b in zip(out.unbind(), ref.unbind()):
        assert_close_to_golden(a, b.detach())
    (got, g) = grads_of((q, k, v), out)
    loss = sum((o * gi).sum() for o, gi in zip(ref.unbind(), g))
    want = [t.unbind() for t in torch.autograd.grad(loss, (q2, k2, v2))]
    for name, a, b in zip("qkv", got, want):
        for x, y in zip(a, b):
            assert_close_to_golden(x, y, name=f"d{name}")


def test_causal_where_torch_refuses():
    (q, qs), (k, ks), (v, vs) = (nested([4, 9, 1], seed=s) for s in range(3))
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True)
    out = subquad.sdpa(q, k, v, is_causal=True)
    refs = per_sequence(qs, ks, vs, is_causal=True)
    for a, b in zip(out.unbind(), refs):
        assert_close_to_golden(a, b)


def test_masks_as_mask_mod_where_torch_refuses():
    (q, qs), (k, ks), (v, vs) = (nested([6, 3], seed=s) for s in range(3))
    prefix = torch.tensor([2, 1])  # per sequence: keys before prefix[b] always visible, else causal
    out = subquad.attention(q, k, v, mask_mod=lambda b, h, i, j: (j < prefix[b]) | (j <= i))
    for s, (a, qq, kk, vv) in enumerate(zip(out.unbind(), qs, ks, vs)):
        L = qq.shape[1]
        i, j = torch.arange(L).view(-1, 1), torch.arange(L).view(1, -1)
        assert_close_to_golden(a, ORIGINAL_SDPA(qq, kk, vv, attn_mask=(j < prefix[s]) | (j <= i)))
    with pytest.raises(NotImplementedError, match="attn_mask with nested tensors: pass the mask as a mask_mod"):
        subquad.sdpa(q, k, v, attn_mask=torch.ones(6, 6, dtype=torch.bool))


def test_cross_attention_gqa_and_gradients():
    (q, qs), (k, ks), (v, vs) = nested([4, 2], H=4, seed=0), nested([7, 5], H=2, seed=1), nested([7, 5], H=2, seed=2)
    out, lse = subquad.attention(q, k, v, enable_gqa=True, is_causal=True, return_lse=True, chunk_size=(2, 3))
    assert lse.is_nested and [t.shape for t in lse.unbind()] == [(4, 4), (4, 2)]
    refs = per_sequence(qs, ks, vs, enable_gqa=True, is_causal=True)
    for a, b in zip(out.unbind(), refs):
        assert_close_to_golden(a, b)
    got, g = grads_of((q, k, v), out)
    q2, k2, v2 = ([t.detach().clone().requires_grad_() for t in ts] for ts in (qs, ks, vs))
    loss = sum((o * gi).sum() for o, gi in zip(per_sequence(q2, k2, v2, enable_gqa=True, is_causal=True), g))
    loss.backward()
    for name, a, b in zip("qkv", got, (q2, k2, v2)):
        for x, y in zip(a, b):
            assert_close_to_golden(x, y.grad, name=f"d{name}")


def test_explain_and_bad_inputs():
    (q, _), (k, _), (v, _) = (nested([6, 3], seed=s, grad=False) for s in range(3))
    plan = subquad.explain(q, k, v, is_causal=True, memory_budget="1MiB")
    assert "2 packed sequences (longest Lq=6, Lk=6; 9 x 9 rows in all)" in str(plan)
    strided = torch.nested.nested_tensor([torch.randn(2, 3, 8), torch.randn(2, 3, 8)])  # the strided layout
    with pytest.raises(NotImplementedError, match="query is a strided nested tensor; subquad takes jagged ones"):
        subquad.sdpa(strided, strided, strided)
    (q3, _) = nested([6, 3, 2], seed=0, grad=False)
    with pytest.raises(ValueError, match="same number of sequences, got 3, 2, 2"):
        subquad.sdpa(q3, k, v)
