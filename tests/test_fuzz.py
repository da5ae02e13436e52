"""Property-based tests: random calls against a materialized float64 reference.

Every combination of masking (causal flags, torch's CausalBias masks, bool and float masks of any
rank that broadcasts, with fully masked rows, mask_mods that hide every visible key of a row),
batch dims (extra leading ones, any of them 0, keys and values shared by the batch), empty heads
and lengths, scales (zero, negative and underflowing included), score_mods, tile sizes and
backends must match the reference, lse and gradients included. bfloat16 calls (head dims from 32
among them) run on a CPU with bfloat16 products or on one without (faked, tests/_machine.py), so
the tiles' offset products are drawn too. Their output and lse are held to the float32-score
reference rounded to bfloat16 (SDPA's for half inputs, tests/test_half.py), their gradients to the
worse of two honest bfloat16 backwards: the same-dtype naive one and FlashAttention's in float32,
which takes D from the rounded output.

The examples are split into ``SHARDS`` tests that xdist runs side by side, each with its own
hypothesis seed (run seed · ``SHARDS`` + shard). The run seed is 0 by default: CI sees the same
examples every run.

``SUBQUAD_FUZZ_EXAMPLES=N``
    examples in all (default 2000: about 20 s on two cores).
``SUBQUAD_FUZZ_SEED=random``
    a fresh run seed (the same in every xdist worker of the run), reported as a
    :class:`FuzzSeed` warning; ``SUBQUAD_FUZZ_SEED=S`` replays run ``S`` (with the same
    ``SUBQUAD_FUZZ_EXAMPLES``: a seed's examples depend on the count).
``SUBQUAD_FUZZ_FAILURES=PATH``
    each failing shard appends one line to ``PATH``: the command that replays it, and its error.
"""

from __future__ import annotations

import math
import os
import random
import time
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import subquad
from _machine import fake_cpu
from conftest import assert_close_to_golden, naive_attention

EXAMPLES = int(os.environ.get("SUBQUAD_FUZZ_EXAMPLES", "2000"))
SHARDS = 4


class FuzzSeed(UserWarning):
    """The run seed of a ``SUBQUAD_FUZZ_SEED=random`` run (shown in pytest's warnings summary)."""


def _run_seed() -> int:
    raw = os.environ.get("SUBQUAD_FUZZ_SEED", "").strip()
    if not raw:
        return 0
    if raw == "random":
        # xdist gives every worker of a run the same id; without xdist, a fresh number.
        run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
        return int(run_id[:8], 16) if run_id else random.SystemRandom().randrange(2**32)
    return int(raw)


RUN_SEED = _run_seed()
FUZZ = settings(
    max_examples=math.ceil(EXAMPLES / SHARDS),
    deadline=None,
    database=None,
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
SCORE_MODS = {
    "none": None,
    "alibi": subquad.mods.alibi(4),  # Hq <= 4
    "soft-cap": lambda s, b, h, i, j: 5.0 * torch.tanh(s / 5.0),
    "by-position": lambda s, b, h, i, j: s + 0.25 * (i - j) + b - h,
}
# hypothesis draws the first entries of a list most often (and shrinks towards them): each list
# starts with what matters most to the tiles (a mask on the scores, scale 0, the offset products).
MASKING = [
    "bool",
    "none",
    "float-inf",
    "causal",
    "mask_mod",
    "upper-left",
    "lower-right",
    "mask_mod+causal",
    "bool+causal_mod",
    "float+causal_mod",
]
SCALES = [None, 0.0, 1e-45, -0.7, 3.0, 0.25, -0.0, 1e-30, -1e-40, 1e-46]
# bfloat16 head dims: the tiles take bfloat16 products from 32 on (on a CPU that has them).
HEAD_DIMS = {"float64": [8, 1, 3], "bfloat16": [32, 64, 8, 33]}
# A dim of size 0 in a third of the calls (hypothesis draws each entry alike): a batch dim (B or
# an extra leading one) in two of those five, the heads or a length in the others.
EMPTY = [None] * 10 + ["batch", "batch", "Lk", "H", "Lq"]


@st.composite
def calls(draw):
    dtype = draw(st.sampled_from(["float64", "bfloat16"]))
    lead = draw(st.lists(st.sampled_from([2, 1, 3]), min_size=1, max_size=3))
    Hk = draw(st.integers(1, 2))
    G = draw(st.sampled_from([1, 2]))
    empty = draw(st.sampled_from(EMPTY))
    # A call with nothing to compute may be long: many tiles to plan, none to run.
    longest = 150 if empty else 20
    Lq = draw(st.integers(1, longest))
    Lk = draw(st.integers(1, longest))
    if empty == "batch":
        lead[draw(st.integers(0, len(lead) - 1))] = 0
    Hk, Lq, Lk = (0 if empty == "H" else Hk), (0 if empty == "Lq" else Lq), (0 if empty == "Lk" else Lk)
    scores = (*lead, Hk * G, Lq, Lk)
    # A mask of any rank up to the scores' (the full rank first), each of its dims the scores'
    # or 1 (broadcast); key/value batch dims likewise.
    mask_rank = len(scores) - draw(st.integers(0, len(scores) - 1))
    mask_ones = draw(st.lists(st.booleans(), min_size=mask_rank, max_size=mask_rank))
    kv_ones = draw(st.lists(st.booleans(), min_size=len(lead), max_size=len(lead)))
    return dict(
        dtype=dtype,
        bf16_products=draw(st.booleans()) if dtype == "bfloat16" else False,
        shape=(tuple(lead), Hk, G, Lq, Lk, draw(st.sampled_from(HEAD_DIMS[dtype]))),
        kv_lead=tuple(1 if one else n for one, n in zip(kv_ones, lead)),
        masking=draw(st.sampled_from(MASKING)),
        mask_shape=tuple(1 if one else n for one, n in zip(mask_ones, scores[-mask_rank:])),
        mask_mod=draw(st.sampled_from(sorted(MASK_MODS))),
        score_mod=draw(st.sampled_from(list(SCORE_MODS))),
        scale=draw(st.sampled_from(SCALES)),
        backend=draw(st.sampled_from(["auto", "matmul", "fused"])),
        chunk=draw(st.one_of(st.none(), st.tuples(st.integers(1, 9), st.integers(1, 9)))),
        grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _build(case):
    """The call's keywords, and the same masking as one dense float64 mask of the scores' shape
    ``(*lead, Hq, Lq, Lk)`` for the reference."""
    lead, Hk, G, Lq, Lk, _ = case["shape"]
    Hq = Hk * G
    dtype = getattr(torch, case.get("dtype", "float64"))
    mask_shape = case.get("mask_shape", (Lq, Lk))
    g = torch.Generator().manual_seed(case["seed"])
    qi = torch.arange(Lq).view(-1, 1)
    ki = torch.arange(Lk).view(1, -1)
    keep = torch.ones(*lead, Hq, Lq, Lk, dtype=torch.bool)
    add = torch.zeros(*lead, Hq, Lq, Lk, dtype=torch.float64)
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
        mask = torch.rand(mask_shape, generator=g) > 0.4
        if len(mask_shape) > 1 and mask_shape[-2] > 1:
            mask[..., 0, :] = False  # a fully masked row
        kw["attn_mask"] = mask
        keep &= mask
    if m in ("float-inf", "float+causal_mod"):
        mask = torch.randn(mask_shape, generator=g, dtype=torch.float64)
        mask = mask.masked_fill(torch.rand(mask_shape, generator=g) > 0.6, float("-inf")).to(dtype)
        kw["attn_mask"] = mask
        add = add + mask.double().masked_fill(mask == float("-inf"), 0.0)
        keep &= mask != float("-inf")
    if m in ("mask_mod", "mask_mod+causal"):
        kw["mask_mod"] = mod
        b = torch.arange(math.prod(lead)).view(*lead, 1, 1, 1)
        h = torch.arange(Hq).view(-1, 1, 1)
        keep &= mod(b, h, qi, ki)
        if m == "mask_mod+causal":
            kw["is_causal"] = True
            keep &= ki <= qi
    if m in ("bool+causal_mod", "float+causal_mod"):
        kw["mask_mod"] = subquad.mods.causal()
        keep &= ki <= qi
    dense = add.masked_fill(~keep, float("-inf"))
    return kw, dense


def _tensors(case):
    lead, Hk, G, Lq, Lk, E = case["shape"]
    kv_lead = case["kv_lead"]
    g = torch.Generator().manual_seed(case["seed"] + 1)
    q = torch.randn(*lead, Hk * G, Lq, E, generator=g, dtype=torch.float64) * 2
    k = torch.randn(*kv_lead, Hk, Lk, E, generator=g, dtype=torch.float64) * 2
    v = torch.randn(*kv_lead, Hk, Lk, E, generator=g, dtype=torch.float64)
    dtype = getattr(torch, case["dtype"])
    return [t.to(dtype).requires_grad_(case["grad"]) for t in (q, k, v)]


def _reference(case, q, k, v, dense, weights, dtype):
    """``(out, lse, gradients)`` of the materialized reference on ``q, k, v`` taken in ``dtype``
    (float64: the golden; float32: SDPA's reference for half inputs; the call's dtype: the
    same-dtype naive reference), each rounded to the call's dtype but the lse."""
    G = case["shape"][2]
    ts = [t.detach().to(dtype).requires_grad_(case["grad"]) for t in (q, k, v)]
    out, lse = naive_attention(
        *ts, attn_mask=dense.to(dtype), scale=case["scale"], enable_gqa=G > 1,
        score_mod=SCORE_MODS[case["score_mod"]], return_lse=True,
    )  # fmt: skip
    grads = torch.autograd.grad(out, ts, weights.to(dtype)) if case["grad"] else ()
    rounded = q.dtype
    return out.detach().to(rounded), lse.detach(), [d.to(rounded) for d in grads]


def _flash_gradients(case, q, k, v, dense, weights):
    """The gradients of FlashAttention's backward in float32, rounded to the call's dtype: it
    takes ``D = rowsum(dO ∘ O)`` from the output as returned, rounded to the call's dtype (so do
    torch's fused CPU kernel and subquad's tiles), which moves ``dS = P ∘ (dP - D)`` by ``-P ε``
    with ``ε = rowsum(dO ∘ (round(O) - O))``: the exact gradients plus those of the lse weighted
    by ``-ε``. Where the gradients cancel (a small dK from large q) that is most of their error."""
    G = case["shape"][2]
    kw = dict(scale=case["scale"], enable_gqa=G > 1, score_mod=SCORE_MODS[case["score_mod"]])
    ts = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out = naive_attention(*ts, attn_mask=dense.float(), **kw)
    # A row that sees no key has an lse of -inf (a NaN gradient) and an output of 0 in any dtype
    # (ε = 0): here it sees every key.
    hidden = torch.isneginf(dense).all(dim=-1, keepdim=True)
    _, lse = naive_attention(*ts, attn_mask=dense.float().masked_fill(hidden, 0.0), return_lse=True, **kw)
    d_out = weights.float()
    eps = (d_out * (out.detach().to(q.dtype).float() - out.detach())).sum(dim=-1)
    exact = torch.autograd.grad(out, ts, d_out)
    shift = torch.autograd.grad(lse, ts, -eps, allow_unused=True, materialize_grads=True)  # v: unused
    return [(a + b).to(q.dtype) for a, b in zip(exact, shift)]


def _worse(golden, *references):
    """The reference farther from ``golden``."""
    return max(references, key=lambda r: (r.double() - golden.double()).abs().max().item() if r.numel() else 0.0)


def check_call(case):
    """One drawn call against the float64 golden (bfloat16: and the references of the module's
    docstring)."""
    G = case["shape"][2]
    q, k, v = _tensors(case)
    kw, dense = _build(case)
    with pytest.MonkeyPatch.context() as mp:
        fake_cpu(mp, "avx512-bf16" if case["bf16_products"] else "avx2")
        try:
            out, lse = subquad.attention(
                q, k, v, scale=case["scale"], enable_gqa=G > 1, backend=case["backend"], chunk_size=case["chunk"],
                score_mod=SCORE_MODS[case["score_mod"]], return_lse=True, **kw,
            )  # fmt: skip
        except NotImplementedError as e:  # a forced backend that cannot run this call says so
            assert case["backend"] != "auto", e
            return
        g = torch.Generator().manual_seed(case["seed"] + 2)
        weights = torch.randn(out.shape, generator=g, dtype=torch.float64).to(q.dtype)
        got = torch.autograd.grad(out, (q, k, v), weights) if case["grad"] else ()
    golden, golden_lse, golden_grads = _reference(case, q, k, v, dense, weights, torch.float64)
    if q.dtype == torch.float64:
        ref, ref_lse, ref_grads = None, None, [None] * len(got)
        floors = dict(out=1e-10, lse=1e-10, grads=1e-9)
    else:
        ref, ref_lse, _ = _reference(case, q, k, v, dense, weights, torch.float32)
        # The gradients round P and dS to bfloat16 for their products and take D from the rounded
        # output (as the fused kernels do): held to the worse of the same-dtype naive reference,
        # which rounds products too, and FlashAttention's backward in float32.
        ref_grads = []
        if case["grad"]:
            naive_grads = _reference(case, q, k, v, dense, weights, q.dtype)[2]
            flash_grads = _flash_gradients(case, q, k, v, dense, weights)
            ref_grads = [_worse(gold, a, b) for gold, a, b in zip(golden_grads, naive_grads, flash_grads)]
        # The lse to a bfloat16 ulp (2^-8): bfloat16 products put about 2e-3 into it (the
        # offsets' rounding, subquad._backends.products), the fused kernel 5e-5.
        floors = dict(out=None, lse=4e-3, grads=None)
    assert_close_to_golden(out, golden, ref, floor=floors["out"], name=f"output of {case}")
    assert_close_to_golden(lse, golden_lse, ref_lse, floor=floors["lse"], name=f"lse of {case}")
    for name, a, b, r in zip("qkv", got, golden_grads, ref_grads):
        assert_close_to_golden(a, b, r, floor=floors["grads"], name=f"d{name} of {case}")


@pytest.mark.parametrize("shard", range(SHARDS), ids=lambda i: f"shard{i}")
def test_random_calls_match_the_materialized_reference(shard, request):
    hypothesis_seed = RUN_SEED * SHARDS + shard
    replay = (
        f"SUBQUAD_FUZZ_SEED={RUN_SEED} SUBQUAD_FUZZ_EXAMPLES={EXAMPLES} "
        f"python -m pytest -n 0 'tests/test_fuzz.py::{request.node.name}'"
    )
    if os.environ.get("SUBQUAD_FUZZ_SEED", "").strip() == "random":
        print(f"fuzz run seed {RUN_SEED}; replay: {replay}")
        warnings.warn(f"fuzz run seed {RUN_SEED} (replay one shard: {replay})", FuzzSeed, stacklevel=1)
    try:
        FUZZ(seed(hypothesis_seed)(given(case=calls())(check_call)))()
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        failures = os.environ.get("SUBQUAD_FUZZ_FAILURES")
        if failures:
            with open(failures, "a", encoding="utf-8") as f:
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {replay}  # {type(e).__name__}: {first_line[:300]}\n")
        raise AssertionError(f"fuzz run seed {RUN_SEED} failed; replay: {replay}") from e


@pytest.mark.parametrize("masking", MASKING)
def test_every_masking_kind_is_reachable(masking):
    case = dict(shape=((1,), 1, 1, 5, 5, 4), masking=masking, mask_mod="not-diagonal", seed=0)
    _, dense = _build(case)
    assert dense.shape == (1, 1, 5, 5)
