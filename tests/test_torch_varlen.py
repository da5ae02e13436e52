"""torch.nn.attention.varlen.varlen_attn on the CPU after subquad.integrations.torch_varlen.enable().

Checked against SDPA run on each sequence alone (float64), with gradients through torch's own
autograd registration of the operators; causal and windows are bottom-right aligned per sequence.
"""

from __future__ import annotations

import pytest
import torch

varlen = pytest.importorskip("torch.nn.attention.varlen")

import subquad.integrations.torch_varlen as tv  # noqa: E402
from conftest import assert_close_to_golden  # noqa: E402
from subquad.integrations.patch import ORIGINAL_SDPA  # noqa: E402

f64 = torch.float64


@pytest.fixture(autouse=True)
def enabled():
    tv.enable()
    yield
    tv.disable()


def packed(lq, lk, Hq=4, Hk=2, E=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), Hq, E, generator=g, dtype=f64, requires_grad=True)
    k = torch.randn(int(cu_k[-1]), Hk, E, generator=g, dtype=f64, requires_grad=True)
    v = torch.randn(int(cu_k[-1]), Hk, E, generator=g, dtype=f64, requires_grad=True)
    return q, k, v, cu_q, cu_k


def reference(q, k, v, cu_q, cu_k, window=(-1, -1)):
    outs = []
    for a, b, c, d in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        i = torch.arange(b - a).view(-1, 1) + (d - c) - (b - a)  # bottom-right: row i faces key i + Lk - Lq
        j = torch.arange(d - c).view(1, -1)
        keep = torch.ones(b - a, d - c, dtype=torch.bool)
        if window[0] >= 0:
            keep &= j >= i - window[0]
        if window[1] >= 0:
            keep &= j <= i + window[1]
        o = ORIGINAL_SDPA(
            q[a:b].transpose(0, 1),
            k[c:d].transpose(0, 1),
            v[c:d].transpose(0, 1),
            attn_mask=keep,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        outs.append(torch.nan_to_num(o).transpose(0, 1))  # rows that see nothing: 0
    return torch.cat(outs)


@pytest.mark.parametrize(
    "window", [(-1, -1), (-1, 0), (2, 0), (1, 2)], ids=["full", "causal", "causal-window", "window"]
)
def test_varlen_attn_runs_on_the_cpu_with_gradients(window):
    q, k, v, cu_q, cu_k = packed([3, 8, 1, 6], [5, 8, 4, 2])
    out, lse = varlen.varlen_attn(
        q, k, v, cu_q, cu_k, 8, 8, window_size=window, enable_gqa=True, return_aux=varlen.AuxRequest(lse=True)
    )
    ref = reference(q, k, v, cu_q, cu_k, window)
    # lse (H, total_q): float32 as torch's, except that float64 inputs (which torch's kernels do not take) keep float64.
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == f64
    assert_close_to_golden(out, ref.detach())
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for name, a, b in zip("qkv", got, want):
        assert_close_to_golden(a, b, name=f"d{name}")


def test_out_variant_seqused_k_and_paged_keys():
    q, k, v, cu_q, cu_k = packed([2, 3], [8, 8], Hq=2, Hk=2)
    q, k, v = (t.detach() for t in (q, k, v))
    used = torch.tensor([5, 8], dtype=torch.int32)
    out = torch.empty_like(q)
    varlen.varlen_attn_out(out, q, k, v, cu_q, cu_k, 3, 8, seqused_k=used, window_size=(-1, 0))
    keep = torch.cat([torch.arange(0, 5), torch.arange(8, 16)])
    cu_used = torch.tensor([0, 5, 13], dtype=torch.int32)
    assert_close_to_golden(out, reference(q, k[keep], v[keep], cu_q, cu_used, (-1, 0)))
    # The same keys as a paged pool: pages of 4 tokens, in a shuffled order.
    pages = torch.stack([k[i : i + 4] for i in range(0, 16, 4)]), torch.stack([v[i : i + 4] for i in range(0, 16, 4)])
    order = torch.tensor([2, 0, 3, 1])
    pool_k, pool_v = pages[0][order], pages[1][order]
    where = {int(p): n for n, p in enumerate(order)}  # physical page of each logical page
    table = torch.tensor([[where[0], where[1]], [where[2], where[3]]], dtype=torch.int32)
    paged = varlen.varlen_attn(
        q, pool_k, pool_v, cu_q, None, 3, 8, seqused_k=used, block_table=table, window_size=(-1, 0)
    )
    assert_close_to_golden(paged, out)


def test_disable_hands_back_torchs_kernels_and_options_are_checked():
    q, k, v, cu_q, cu_k = packed([3], [3], Hq=2, Hk=2)
    tv.disable()
    assert tv.enabled() == ()
    with pytest.raises(NotImplementedError, match="_flash_attention_forward"):
        varlen.varlen_attn(q, k, v, cu_q, cu_k, 3, 3)
    tv.enable(memory_budget="64MiB")
    tv.enable(memory_budget="64MiB")  # idempotent
    assert tv.enabled() == ("cpu", "mps")
    assert varlen.varlen_attn(q, k, v, cu_q, cu_k, 3, 3).shape == q.shape
    with pytest.raises(TypeError, match=r"unexpected option\(s\) \['budget'\]"):
        tv.enable(budget="1GiB")
    with pytest.raises(ValueError, match="Expect query and key/value to have the same number of heads"):
        varlen.varlen_attn(q, k[:, :1], v[:, :1], cu_q, cu_k, 3, 3)  # torch's own check, before the kernel


def test_a_torch_without_the_operators_is_told_which_it_needs(monkeypatch):
    monkeypatch.setattr(tv, "_ops", lambda: None)  # what torch 2.9 and older give
    with pytest.raises(RuntimeError, match=r"has no torch.nn.attention.varlen operators .* torch 2.10 or newer"):
        tv.enable()
