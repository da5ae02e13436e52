"""subquad.patch_sdpa: routing, semantics, restoration (also on error), nesting, re-entrancy."""

import pytest
import torch
import torch.nn.functional as F

import subquad
from subquad.integrations.patch import ORIGINAL_SDPA

MANY_TILES = (7, 5)


def _qkv(*shape_q, lk=None, hk=None, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    *lead, h, lq, e = shape_q
    lk = lq if lk is None else lk
    hk = h if hk is None else hk
    q = torch.randn(*lead, h, lq, e, generator=g, dtype=dtype)
    k = torch.randn(*lead, hk, lk, e, generator=g, dtype=dtype)
    v = torch.randn(*lead, hk, lk, e, generator=g, dtype=dtype)
    return q, k, v


def _close(test, golden, *, tol=1e-10, what="output"):
    err = (test - golden).abs().max().item()
    scale = golden.abs().max().item() or 1.0
    assert err <= tol * scale, f"{what}: max abs error {err:.3e} > {tol:.1e} x {scale:.3e}"


CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "bool-mask": dict(attn_mask="bool"),
    "float-mask": dict(attn_mask="float"),
    "scale": dict(scale=0.3),
    "gqa": dict(enable_gqa=True),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_patched_matches_torch_sdpa(case):
    kw = dict(CASES[case])
    q, k, v = _qkv(2, 4, 33, 16, lk=41, hk=2 if kw.get("enable_gqa") else None)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(2, 1, 33, 41, generator=torch.Generator().manual_seed(1)) > 0.3
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(33, 41, dtype=torch.float64)
    golden = ORIGINAL_SDPA(q, k, v, **kw)
    with subquad.patch_sdpa(chunk_size=MANY_TILES):
        assert F.scaled_dot_product_attention is not ORIGINAL_SDPA
        out = F.scaled_dot_product_attention(q, k, v, **kw)
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    _close(out, golden, what=case)


def test_routes_every_call_with_the_options(monkeypatch):
    calls = []
    real = subquad.sdpa

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(subquad, "sdpa", spy)
    q, k, v = _qkv(1, 2, 9, 8)
    with subquad.patch_sdpa(chunk_size=MANY_TILES, backend="matmul"):
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
        torch.nn.functional.scaled_dot_product_attention(q, k, v, None, 0.0, True)  # positional, as SDPA allows
    assert len(calls) == 2
    assert all(c["chunk_size"] == MANY_TILES and c["backend"] == "matmul" for c in calls)
    assert calls[1]["is_causal"] is True


def test_restores_when_the_body_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with subquad.patch_sdpa():
            raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


def test_restores_when_the_attention_raises():
    q, k, v = _qkv(1, 2, 9, 8)
    with pytest.raises(ValueError, match="key.shape"):
        with subquad.patch_sdpa():
            F.scaled_dot_product_attention(q, k[..., :4], v)
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


def test_nested_blocks_restore_in_order(monkeypatch):
    seen = []
    real = subquad.sdpa
    monkeypatch.setattr(subquad, "sdpa", lambda *a, **kw: seen.append(kw.get("chunk_size")) or real(*a, **kw))
    q, k, v = _qkv(1, 2, 9, 8)
    with subquad.patch_sdpa(chunk_size=(2, 2)):
        outer = F.scaled_dot_product_attention
        with subquad.patch_sdpa(chunk_size=(3, 3)):
            F.scaled_dot_product_attention(q, k, v)
        assert F.scaled_dot_product_attention is outer
        F.scaled_dot_product_attention(q, k, v)
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    assert seen == [(3, 3), (2, 2)]


def test_sdpa_called_from_inside_subquad_goes_to_the_original(monkeypatch):
    # An engine that looks the function up on torch.nn.functional must not recurse into itself.
    def engine_like(q, k, v, **kw):
        kw = {n: kw[n] for n in ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")}
        return F.scaled_dot_product_attention(q, k, v, **kw)

    monkeypatch.setattr(subquad, "sdpa", engine_like)
    q, k, v = _qkv(1, 2, 9, 8)
    with subquad.patch_sdpa():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    _close(out, ORIGINAL_SDPA(q, k, v, is_causal=True))


def test_gradients_flow_through_the_patch():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 19, 8))
    with subquad.patch_sdpa(chunk_size=MANY_TILES):
        F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum().backward()
    got = [t.grad for t in (q, k, v)]
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ORIGINAL_SDPA(q2, k2, v2, is_causal=True).square().sum().backward()
    for name, a, b in zip("qkv", got, (q2.grad, k2.grad, v2.grad)):
        _close(a, b, what=f"d{name}")


@pytest.mark.parametrize("option", ["return_lse", "attn_mask", "memory"])
def test_rejects_unknown_options(option):
    with pytest.raises(TypeError, match=f"unexpected option.*'{option}'"):
        with subquad.patch_sdpa(**{option: 1}):
            pass
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


# ----------------------------------------------------------------- exits out of order, threads
def _spy_chunks(monkeypatch):
    import threading

    seen = []
    real = subquad.sdpa

    def spy(*a, **kw):
        seen.append((threading.current_thread().name, kw.get("chunk_size")))
        return real(*a, **kw)

    monkeypatch.setattr(subquad, "sdpa", spy)
    return seen


def test_blocks_exiting_out_of_order_restore_torch_at_the_last_exit(monkeypatch):
    seen = _spy_chunks(monkeypatch)
    q, k, v = _qkv(1, 2, 9, 8)
    a, b = subquad.patch_sdpa(chunk_size=(2, 2)), subquad.patch_sdpa(chunk_size=(3, 3))
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert F.scaled_dot_product_attention is not ORIGINAL_SDPA  # b is still active
    F.scaled_dot_product_attention(q, k, v)
    b.__exit__(None, None, None)
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA
    assert [c for _, c in seen] == [(3, 3)]


def test_threads_each_use_their_own_block_and_others_see_the_newest(monkeypatch):
    import threading

    seen = _spy_chunks(monkeypatch)
    q, k, v = _qkv(1, 2, 9, 8)
    entered, release = threading.Event(), threading.Event()

    def worker():
        with subquad.patch_sdpa(chunk_size=(4, 4)):
            F.scaled_dot_product_attention(q, k, v)
            entered.set()
            release.wait(10)
            F.scaled_dot_product_attention(q, k, v)

    t = threading.Thread(target=worker, name="worker")
    with subquad.patch_sdpa(chunk_size=(2, 2)):
        t.start()
        assert entered.wait(10)
        F.scaled_dot_product_attention(q, k, v)  # this thread's own block, though the worker entered later
        release.set()
        t.join(10)
        assert F.scaled_dot_product_attention is not ORIGINAL_SDPA  # the main block is still active
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA

    bystander_seen = []
    holder = subquad.patch_sdpa(chunk_size=(5, 5))
    holder.__enter__()
    try:
        b = threading.Thread(target=lambda: bystander_seen.append(F.scaled_dot_product_attention(q, k, v)), name="bystander")
        b.start()
        b.join(10)
    finally:
        holder.__exit__(None, None, None)
    assert ("worker", (4, 4)) in seen and ("MainThread", (2, 2)) in seen
    assert ("bystander", (5, 5)) in seen  # a thread without a block of its own: the newest active one
    assert F.scaled_dot_product_attention is ORIGINAL_SDPA


# ----------------------------------------------------------------- torch's CausalBias masks
def test_causal_bias_through_the_patch_and_through_a_bound_function():
    import warnings

    from torch.nn.attention.bias import causal_lower_right, causal_upper_left

    bound = F.scaled_dot_product_attention  # bound before the block, as `from ... import` at import time
    q, k, v = _qkv(1, 2, 9, 8, lk=13)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        masks = [causal_upper_left(9, 13), causal_lower_right(9, 13)]
    for mask in masks:
        golden = ORIGINAL_SDPA(q, k, v, attn_mask=mask._materialize())
        with subquad.patch_sdpa(chunk_size=MANY_TILES):
            _close(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), golden, what="patched")
            _close(bound(q, k, v, attn_mask=mask), golden, what="bound before the patch")
        _close(bound(q, k, v, attn_mask=mask), golden, what="after the patch")
    from torch.nn.attention.bias import CausalBias

    assert CausalBias.__dict__["__torch_function__"].__func__.__module__ == "torch.nn.attention.bias"
