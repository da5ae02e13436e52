"""Property-based tests: random calls against a materialized float64 reference.

Every combination of masking (causal flags, torch's CausalBias masks, bool and float masks with
fully masked rows, mask_mods that hide every visible key of a row), scales (zero and negative
included), tile sizes and backends must match the reference, lse included. The examples are
fixed (``derandomize``), so CI sees the same ones every run; set ``SUBQUAD_FUZZ_EXAMPLES`` for more.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import subquad
from conftest import assert_close_to_golden, naive_attention

EXAMPLES = int(os.environ.get("SUBQUAD_FUZZ_EXAMPLES", "80"))
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# mask_mods, each with a readable name; several hide every key a causal row can see.
MASK_MODS = {
    "not-diagonal": lambda b, h, i, j: i != j,
    "strictly-before": lambda b, h, i, j: j < i,
    "window-2": lambda b, h, i, j: (j - i).abs() <= 2,
    "every-third": lambda b, h, i, j: (i + 2 * j) % 3 != 0,
    "by-head": lambda b, h, i, j: (j + h) % 2 == 0,
}
MASKING = [
    "none", "causal", "upper-left", "lower-right", "bool", "float-inf", "mask_mod", "mask_mod+causal",
    "bool+causal_mod", "float+causal_mod",
]


@st.composite
def calls(draw):
    B = draw(st.integers(1, 2))
    Hk = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 2]))
    Lq = draw(st.integers(1, 20))
    Lk = draw(st.integers(1, 20))
    E = draw(st.sampled_from([1, 3, 8]))
    return dict(
        shape=(B, Hk, G, Lq, Lk, E),
        masking=draw(st.sampled_from(MASKING)),
        mask_mod=draw(st.sampled_from(sorted(MASK_MODS))),
        scale=draw(st.sampled_from([None, 0.0, -0.7, 0.25, 3.0])),
        backend=draw(st.sampled_from(["auto", "fused", "matmul"])),
        chunk=draw(st.one_of(st.none(), st.tuples(st.integers(1, 9), st.integers(1, 9)))),
        grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _build(case):
    """The call's keywords, and the same masking as one dense float mask for the reference."""
    B, Hk, G, Lq, Lk, E = case["shape"]
    g = torch.Generator().manual_seed(case["seed"])
    qi = torch.arange(Lq).view(-1, 1)
    ki = torch.arange(Lk).view(1, -1)
    keep = torch.ones(B, Hk * G, Lq, Lk, dtype=torch.bool)
    add = torch.zeros(B, Hk * G, Lq, Lk, dtype=torch.float64)
    kw = {}
    m = case["masking"]
    mod = MASK_MODS[case["mask_mod"]]
    if m == "causal":
        kw["is_causal"] = True
        keep &= ki <= qi
    elif m in ("upper-left", "lower-right"):
        from torch.nn.attention.bias import causal_lower_right, causal_upper_left

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kw["attn_mask"] = (causal_upper_left if m == "upper-left" else causal_lower_right)(Lq, Lk)
        keep &= ki <= qi + (0 if m == "upper-left" else Lk - Lq)
    if m in ("bool", "bool+causal_mod"):
        mask = torch.rand(B, 1, Lq, Lk, generator=g) > 0.4
        mask[:, :, 0] = False  # a fully masked row
        kw["attn_mask"] = mask
        keep &= mask
    if m in ("float-inf", "float+causal_mod"):
        mask = torch.randn(1, Hk * G, Lq, Lk, generator=g, dtype=torch.float64)
        mask = mask.masked_fill(torch.rand(1, Hk * G, Lq, Lk, generator=g) > 0.6, float("-inf"))
        kw["attn_mask"] = mask
        add = add + mask.masked_fill(mask == float("-inf"), 0.0)
        keep &= mask != float("-inf")
    if m in ("mask_mod", "mask_mod+causal"):
        kw["mask_mod"] = mod
        b = torch.arange(B).view(-1, 1, 1, 1)
        h = torch.arange(Hk * G).view(1, -1, 1, 1)
        keep &= mod(b, h, qi.view(1, 1, -1, 1), ki.view(1, 1, 1, -1))
        if m == "mask_mod+causal":
            kw["is_causal"] = True
            keep &= ki <= qi
    if m in ("bool+causal_mod", "float+causal_mod"):
        kw["mask_mod"] = subquad.mods.causal()
        keep &= ki <= qi
    dense = add.masked_fill(~keep, float("-inf"))
    return kw, dense


@FUZZ
@given(case=calls())
def test_random_calls_match_the_materialized_reference(case):
    B, Hk, G, Lq, Lk, E = case["shape"]
    g = torch.Generator().manual_seed(case["seed"] + 1)
    q = torch.randn(B, Hk * G, Lq, E, generator=g, dtype=torch.float64) * 2
    k = torch.randn(B, Hk, Lk, E, generator=g, dtype=torch.float64) * 2
    v = torch.randn(B, Hk, Lk, E, generator=g, dtype=torch.float64)
    kw, dense = _build(case)
    if case["grad"]:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    try:
        out, lse = subquad.attention(
            q, k, v, scale=case["scale"], enable_gqa=G > 1, backend=case["backend"], chunk_size=case["chunk"],
            return_lse=True, **kw,
        )
    except NotImplementedError as e:  # a forced backend that cannot run this call says so
        assert case["backend"] != "auto", e
        return
    golden, golden_lse = naive_attention(
        q.detach(), k.detach(), v.detach(), attn_mask=dense, scale=case["scale"], enable_gqa=G > 1, return_lse=True
    )
    assert_close_to_golden(out, golden, floor=1e-10, name=f"output of {case}")
    assert_close_to_golden(lse, golden_lse, floor=1e-10, name=f"lse of {case}")
    if case["grad"]:
        weights = torch.randn(golden.shape, generator=g, dtype=torch.float64)
        got = torch.autograd.grad(out, (q, k, v), weights)
        q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
        ref = naive_attention(q2, k2, v2, attn_mask=dense, scale=case["scale"], enable_gqa=G > 1)
        want = torch.autograd.grad(ref, (q2, k2, v2), weights)
        for name, a, b in zip("qkv", got, want):
            assert_close_to_golden(a, b, floor=1e-9, name=f"d{name} of {case}")


@pytest.mark.parametrize("masking", MASKING)
def test_every_masking_kind_is_reachable(masking):
    case = dict(shape=(1, 1, 1, 5, 5, 4), masking=masking, mask_mod="not-diagonal", seed=0)
    kw, dense = _build(case)
    assert dense.shape == (1, 1, 5, 5)
