"""The compiled path: FlexAttention with a BlockMask built from subquad's tile states.

Compiling costs seconds per new callback, so these tests share a few module-level callbacks
(torch reuses what it compiled) and the rest of the suite runs with ``SUBQUAD_COMPILE=0``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import subquad
from conftest import assert_close_to_golden, naive_attention, to64
from subquad import mods
from subquad._backends import flex
from subquad._tiles import TILES

pytestmark = pytest.mark.skipif(flex._flex_unavailable_reason() is not None, reason="no FlexAttention in this torch")

H, L = 2, 1024  # 2M scores: above the size where compiling pays off
SLOPES = mods.alibi_slopes(H)


def alibi(score, b, h, q_idx, kv_idx):
    return score - SLOPES[h] * (q_idx - kv_idx)


def softcap(score, b, h, q_idx, kv_idx):
    return 30 * torch.tanh(score / 30)


def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 100


def _qkv(dtype=torch.float32, Hk=H, Lq=L, Lk=L):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(1, H, Lq, 32, generator=g).to(dtype),
        torch.randn(1, Hk, Lk, 32, generator=g).to(dtype),
        torch.randn(1, Hk, Lk, 32, generator=g).to(dtype),
    )


CASES = {
    "alibi+is_causal": dict(score_mod=alibi, is_causal=True),
    "softcap+causal-mask_mod": dict(score_mod=softcap, mask_mod=causal),
    "window-mask_mod": dict(mask_mod=window),
    "alibi+builtin-window": dict(score_mod=alibi, mask_mod=mods.sliding_window(100)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_path_matches_the_reference(case):
    q, k, v = _qkv()
    kw = CASES[case]
    plan = subquad.explain(q, k, v, allow_compile=True, **kw)
    assert plan.backend == "flex", plan
    with torch.no_grad():
        out = subquad.attention(q, k, v, allow_compile=True, **kw)
    assert_close_to_golden(out, naive_attention(*to64(q, k, v), **kw), naive_attention(q, k, v, **kw))


def test_block_mask_skips_the_blocks_subquad_knows_are_empty():
    q, k, v = _qkv()
    TILES.reset()
    with torch.no_grad():
        subquad.attention(q, k, v, mask_mod=window, allow_compile=True)
    # +-100 around the diagonal of 8 x 8 blocks of 128: the diagonal and its two neighbours.
    assert (TILES.computed, TILES.skipped) == (8 + 2 * 7, 64 - 22)


def test_gqa_bf16_and_bottom_right_causal():
    q, k, v = _qkv(torch.bfloat16, Hk=1, Lq=512, Lk=2048)
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(512, 2048)
    kw = dict(score_mod=alibi, mask_mod=window, enable_gqa=True)
    with torch.no_grad():
        out = subquad.attention(q, k, v, attn_mask=None, **kw, allow_compile=True)
        with_bias = subquad.attention(q, k, v, attn_mask=bias, **kw, allow_compile=True)
    assert subquad.explain(q, k, v, attn_mask=bias, **kw, allow_compile=True).backend == "flex"
    assert_close_to_golden(
        out, naive_attention(*to64(q, k, v), **kw), naive_attention(q.float(), k.float(), v.float(), **kw).bfloat16()
    )
    dense = bias._materialize()
    assert_close_to_golden(
        with_bias,
        naive_attention(*to64(q, k, v), attn_mask=dense, **kw),
        naive_attention(q.float(), k.float(), v.float(), attn_mask=dense, **kw).bfloat16(),
    )


def test_block_mask_is_cached_and_follows_in_place_changes_of_its_tensors():
    q, k, v = _qkv()
    ids = torch.zeros(L, dtype=torch.long)
    ids[L // 2 :] = 1
    mask = mods.document(ids)
    with torch.no_grad():
        first = subquad.attention(q, k, v, mask_mod=mask, allow_compile=True)
        assert_close_to_golden(
            first, naive_attention(*to64(q, k, v), mask_mod=mask), naive_attention(q, k, v, mask_mod=mask)
        )
        ids[L // 4 :] = 1  # the same tensor, changed in place: the cached BlockMask must not be reused
        second = subquad.attention(q, k, v, mask_mod=mask, allow_compile=True)
    assert_close_to_golden(
        second, naive_attention(*to64(q, k, v), mask_mod=mask), naive_attention(q, k, v, mask_mod=mask)
    )


def test_a_failed_compile_falls_back_to_the_tiles_with_a_warning(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("lowering failed (simulated)")

    monkeypatch.setattr(flex, "_compiled", lambda static=False: broken)
    monkeypatch.setattr(flex, "_FAILED", {})
    q, k, v = _qkv()

    def score_mod(s, b, h, q_idx, kv_idx):  # a signature of its own
        return s * 0.9

    with torch.no_grad():
        with pytest.warns(
            RuntimeWarning, match=r"FlexAttention could not compile this call \(RuntimeError: lowering failed"
        ):
            out = subquad.attention(q, k, v, score_mod=score_mod, allow_compile=True)
        assert_close_to_golden(
            out, naive_attention(*to64(q, k, v), score_mod=score_mod), naive_attention(q, k, v, score_mod=score_mod)
        )
        plan = subquad.explain(q, k, v, score_mod=score_mod, allow_compile=True)  # not tried again
    assert plan.backend != "flex" and "compiling this signature failed before" in " ".join(plan.rejected["flex"])


def test_compiling_can_be_turned_off(monkeypatch):
    q, k, v = _qkv()
    assert subquad.explain(q, k, v, score_mod=softcap, allow_compile=True).backend == "flex"
    plan = subquad.explain(q, k, v, score_mod=softcap, allow_compile=False)
    assert plan.backend == "matmul" and "compiling is off" in plan.rejected["flex"][0]
    monkeypatch.setenv("SUBQUAD_COMPILE", "0")
    assert subquad.explain(q, k, v, score_mod=softcap).backend == "matmul"
    monkeypatch.setenv("SUBQUAD_COMPILE", "1")
    assert subquad.explain(q, k, v, score_mod=softcap).backend == "flex"
    with pytest.raises(TypeError, match="allow_compile to be a bool"):
        subquad.explain(q, k, v, score_mod=softcap, allow_compile="yes")


def test_calls_the_compiled_path_cannot_serve_run_the_tiles():
    q, k, v = _qkv()
    small = [t[:, :, :64] for t in (q, k, v)]
    reasons = {
        "fewer than": subquad.explain(*small, score_mod=softcap, allow_compile=True),
        "gradients": subquad.explain(q.requires_grad_(), k, v, score_mod=softcap, allow_compile=True),
        "return_lse": subquad.explain(q.detach(), k, v, score_mod=softcap, return_lse=True, allow_compile=True),
        "dropout": subquad.explain(q.detach(), k, v, score_mod=softcap, dropout_p=0.1, allow_compile=True),
        "no score_mod or mask_mod": subquad.explain(q.detach(), k, v, is_causal=True, allow_compile=True),
    }
    for why, plan in reasons.items():
        assert plan.backend != "flex" and any(why in r for r in plan.rejected["flex"]), (why, plan)


def test_explain_says_the_first_call_compiles():
    q, k, v = _qkv()
    plan = subquad.explain(q, k, v, score_mod=alibi, is_causal=True, allow_compile=True)
    assert any(n.startswith("flex:") for n in plan.notes)
    with torch.no_grad():
        subquad.attention(q, k, v, score_mod=alibi, is_causal=True, allow_compile=True)
    plan = subquad.explain(q, k, v, score_mod=alibi, is_causal=True, allow_compile=True)
    assert any("compiled for this signature already" in n for n in plan.notes)


def test_a_missing_compiler_turns_the_path_off_for_every_call(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found (simulated)")

    monkeypatch.setattr(flex, "_compiled", lambda static=False: no_compiler)
    monkeypatch.setattr(flex, "_FAILED", {})
    q, k, v = _qkv()
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="No working C\\+\\+ compiler"):
        subquad.attention(q, k, v, score_mod=softcap, allow_compile=True)
    plan = subquad.explain(q, k, v, score_mod=alibi, mask_mod=window, allow_compile=True)  # another signature
    assert plan.backend != "flex" and "No working C++ compiler" in plan.rejected["flex"][0]


def test_flex_never_runs_uncompiled(monkeypatch):
    # If torch.compile hands back plain Python (dynamo disabled, a frame skipped after a recompile
    # limit), FlexAttention would materialize the scores: subquad refuses and runs the tiles.
    monkeypatch.setattr(flex, "_compiled", lambda static=False: flex._flex_call)
    monkeypatch.setattr(flex, "_FAILED", {})
    q, k, v = _qkv()
    with torch.no_grad(), pytest.warns(RuntimeWarning, match="torch.compile did not compile this call"):
        out = subquad.attention(q, k, v, score_mod=softcap, mask_mod=causal, allow_compile=True)
    assert_close_to_golden(
        out,
        naive_attention(*to64(q, k, v), score_mod=softcap, mask_mod=causal),
        naive_attention(q, k, v, score_mod=softcap, mask_mod=causal),
    )
    assert "did not compile" in subquad.explain(q, k, v, score_mod=alibi, allow_compile=True).rejected["flex"][0]


def test_dynamo_disabled_means_no_flex():
    import torch._dynamo

    q, k, v = _qkv()
    with torch._dynamo.config.patch(disable=True):
        plan = subquad.explain(q, k, v, score_mod=softcap, allow_compile=True)
    assert plan.backend == "matmul" and "torch.compile is disabled" in plan.rejected["flex"][0]


def test_a_kernel_that_compiles_only_with_static_shapes(monkeypatch):
    # Inductor compiles some FlexAttention kernels only without dynamic shapes: the static entry
    # point takes over, and later calls of the signature go to it directly.
    calls = []

    def dynamic(*args):
        calls.append("dynamic")
        raise RuntimeError("CppCompileError: C++ compile error (simulated)")

    real = flex._compiled
    monkeypatch.setattr(flex, "_FAILED", {})
    monkeypatch.setattr(flex, "_STATIC_ONLY", set())
    monkeypatch.setattr(
        flex,
        "_compiled",
        lambda static=False: (lambda *a: (calls.append("static"), real(static=True)(*a))[1]) if static else dynamic,
    )
    q, k, v = _qkv()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            out = subquad.attention(q, k, v, score_mod=softcap, mask_mod=window, allow_compile=True)
    assert calls == ["dynamic", "static", "static"]
    ref = naive_attention(*to64(q, k, v), score_mod=softcap, mask_mod=window)
    assert_close_to_golden(out, ref, naive_attention(q, k, v, score_mod=softcap, mask_mod=window))
