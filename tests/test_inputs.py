"""Every refusal path says which argument is wrong and shows the values."""

from __future__ import annotations

import pytest
import torch

import subquad


def qkv(B=2, H=3, Lq=5, Lk=7, E=8, Ev=8, dtype=torch.float32):
    return (
        torch.randn(B, H, Lq, E, dtype=dtype),
        torch.randn(B, H, Lk, E, dtype=dtype),
        torch.randn(B, H, Lk, Ev, dtype=dtype),
    )


def test_not_a_tensor():
    q, _k, v = qkv()
    with pytest.raises(TypeError, match=r"Expected key to be a torch\.Tensor, got list"):
        subquad.attention(q, [1, 2], v)


def test_non_float():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"Expected query to be a floating-point tensor .* got dtype torch.int64"):
        subquad.attention(q.long(), k, v)


def test_dtype_mismatch():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"same dtype, got query torch.float32, key torch.float64"):
        subquad.attention(q, k.double(), v)


def test_rank_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"same number of dims, got query \(2, 3, 5, 8\), key \(3, 7, 8\)"):
        subquad.attention(q, k[0], v)


def test_too_few_dims():
    with pytest.raises(ValueError, match=r"query to have at least 2 dims"):
        subquad.attention(torch.randn(4), torch.randn(4), torch.randn(4))


def test_head_dim_mismatch():
    q, k, v = qkv()
    with pytest.raises(
        ValueError, match=r"key.shape\[-1\] == query.shape\[-1\] \(E\), got key \(2, 3, 7, 4\) and query \(2, 3, 5, 8\)"
    ):
        subquad.attention(q, k[..., :4], v)


def test_key_value_length_mismatch():
    q, k, v = qkv()
    with pytest.raises(
        ValueError,
        match=r"key.shape\[-2\] == value.shape\[-2\] \(Lk\), got key \(2, 3, 7, 8\) and value \(2, 3, 6, 8\)",
    ):
        subquad.attention(q, k, v[:, :, :6])


def test_batch_mismatch():
    q, _k, _v = qkv()
    k3, v3 = torch.randn(3, 3, 7, 8), torch.randn(3, 3, 7, 8)
    with pytest.raises(ValueError, match=r"same batch dims .* broadcast, got query \(2, 3, 5, 8\), key \(3, 3, 7, 8\)"):
        subquad.attention(q, k3, v3)


def test_key_value_heads_mismatch():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"key and value to agree on their leading dims"):
        subquad.attention(q, k, v[:, :1])


def test_heads_without_gqa():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        subquad.attention(q, k[:, :1], v[:, :1])


def test_gqa_not_divisible():
    q, _k, _v = qkv(H=3)
    with pytest.raises(ValueError, match=r"multiple of the key/value heads, got Hq=3 .* Hk=2"):
        subquad.attention(q, torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8), enable_gqa=True)


@pytest.mark.parametrize("mask", [torch.zeros(5, 6, dtype=torch.bool), torch.zeros(4, 5, 7)], ids=["Lk", "heads"])
def test_mask_not_broadcastable(mask):
    q, k, v = qkv()
    with pytest.raises(
        ValueError, match=r"attn_mask of shape .* does not broadcast to the scores' shape \(2, 3, 5, 7\)"
    ):
        subquad.attention(q, k, v, attn_mask=mask)


def test_integer_mask():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"attn_mask to be a bool tensor .* got dtype torch.int64"):
        subquad.attention(q, k, v, attn_mask=torch.ones(5, 7, dtype=torch.long))


def test_mask_and_causal():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="Explicit attn_mask should not be set when is_causal=True"):
        subquad.attention(q, k, v, attn_mask=torch.ones(5, 7, dtype=torch.bool), is_causal=True)


@pytest.mark.parametrize("chunk", [0, -3, (4,), (4, 0), (2.5, 4), True, "8", (True, 4)])
def test_bad_chunk_size(chunk):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="chunk_size"):
        subquad.attention(q, k, v, chunk_size=chunk)


@pytest.mark.parametrize("p", [-0.1, 1.5, float("nan")])
def test_bad_dropout(p):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"dropout_p in \[0, 1\]"):
        subquad.attention(q, k, v, dropout_p=p)


@pytest.mark.parametrize("p", [True, "0.1", None, torch.ones(2)])
def test_dropout_of_the_wrong_type(p):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="dropout_p to be a number"):
        subquad.attention(q, k, v, dropout_p=p)


@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_bad_scale(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="scale"):
        subquad.attention(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", ["2", True, [1.0]])
def test_scale_of_the_wrong_type(scale):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="scale to be a number"):  # SDPA raises TypeError too
        subquad.attention(q, k, v, scale=scale)


def test_unknown_backend_lists_valid_ones():
    q, k, v = qkv()
    with pytest.raises(
        ValueError,
        match=r"Unknown backend='flash'; expected 'auto' or one of 'sdpa', 'flex', 'fused', 'loops', 'matmul'",
    ):
        subquad.attention(q, k, v, backend="flash")


def test_forced_backend_that_cannot_run():
    q, k, v = qkv(Ev=4)
    with pytest.raises(NotImplementedError, match=r"(?s)backend=.fused. cannot run .*Ev == E"):
        subquad.attention(q, k, v, backend="fused")
    with pytest.raises(NotImplementedError, match=r"(?s)backend=.sdpa. cannot run .*return_lse"):
        subquad.attention(q, k[..., :8], v, backend="sdpa", return_lse=True)


def test_callbacks_must_be_callable():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="score_mod to be None or a callable"):
        subquad.attention(q, k, v, score_mod=3)
    with pytest.raises(TypeError, match="mask_mod to be None or a callable"):
        subquad.attention(q, k, v, mask_mod="causal")


def test_is_causal_must_be_bool():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="is_causal to be a bool"):
        subquad.attention(q, k, v, is_causal=1)


def test_return_lse_must_be_bool():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="return_lse to be a bool"):
        subquad.attention(q, k, v, return_lse="yes")
