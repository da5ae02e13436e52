"""Torch's SDPA on Apple MPS, release by release (issue 55), simulated on the CPU.

Each call runs with every device-specific choice taken as on MPS (``as_device``), ``torch.__version__``
set to the release, and every call subquad makes to torch's SDPA recorded with the arguments torch
receives. Per known defect: on its releases no recorded call meets the defect's condition (written
here from the pytorch issue, not from the router's table) and the output equals float64; on a
release without it, torch gets the call unchanged. The memory model of each path is checked
with fake tensors: the prefill kernels of 2.13 hold no scores, MPSGraph holds them and is capped.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
from torch.torch_version import TorchVersion

import subquad
from _devices import as_device, device_memory, fake_tensors
from conftest import assert_close_to_golden, naive_attention, to64
from subquad import _fast
from subquad._backends import base as backends_base
from subquad._backends import mps_sdpa
from subquad._backends import sdpa as sdpa_module
from subquad._inputs import Inputs

GiB = 1 << 30
HALF = (torch.float16, torch.bfloat16)


@dataclasses.dataclass
class Recorded:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: Optional[torch.Tensor]
    is_causal: bool
    scale: Optional[float]

    @property
    def Lq(self) -> int:
        return self.query.shape[-2]

    @property
    def Lk(self) -> int:
        return self.key.shape[-2]

    @property
    def E(self) -> int:
        return self.query.shape[-1]


class Mps:
    """A simulated Mac: the release is set with :meth:`at`; ``calls`` are torch's SDPA calls."""

    def __init__(self, monkeypatch: Any) -> None:
        self.monkeypatch = monkeypatch
        self.calls: List[Recorded] = []
        real = sdpa_module.TORCH_SDPA

        def record(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            self.calls.append(Recorded(q, k, v, attn_mask, is_causal, scale))
            return real(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )

        monkeypatch.setattr(sdpa_module, "TORCH_SDPA", record)
        as_device(monkeypatch, "mps")
        device_memory(monkeypatch, mps_recommended=48 * GiB)
        _fast.clear()

    def at(self, version: str) -> "Mps":
        self.monkeypatch.setattr(torch, "__version__", TorchVersion(version))
        self.calls.clear()
        return self


@pytest.fixture
def mps(monkeypatch):
    return Mps(monkeypatch)


def _t(*shape, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _decode_kernel_dims(E: int) -> bool:
    return E in (64, 96, 128)


# Each case: the call (args, kwargs), the condition of the pytorch issue on a recorded call, the
# releases it is in, a release without it.
@dataclasses.dataclass
class Case:
    make: Callable[[], Dict[str, Any]]
    meets: Callable[[Recorded], bool]
    affected: List[str]
    fixed: str


def _two_pass_half():
    return dict(query=_t(1, 8, 1, 64), key=_t(1, 8, 2048, 64, seed=1), value=_t(1, 8, 2048, 64, seed=2))


def _transposed_query(B: int):
    # (B, L, H, E).transpose(1, 2): rows H*E apart, batch H*L*E apart
    q = _t(B, 4, 8, 64).transpose(1, 2)
    return dict(query=q, key=_t(B, 8, 256, 64, seed=1), value=_t(B, 8, 256, 64, seed=2))


def _causal_prefill(E: int):
    return dict(query=_t(1, 4, 40, E), key=_t(1, 4, 40, E, seed=1), value=_t(1, 4, 40, E, seed=2), is_causal=True)


CASES: Dict[str, Case] = {
    "174861-two-pass-decode-half": Case(
        _two_pass_half,
        lambda c: (
            c.query.dtype in HALF
            and c.Lq <= 8
            and c.Lk >= 1024
            and _decode_kernel_dims(c.E)
            and c.attn_mask is None
            and not c.is_causal
        ),
        ["2.9.1", "2.10.0"],
        "2.11.0",
    ),
    "169222-decode-keys-not-multiple-of-32": Case(
        lambda: dict(
            query=_t(2, 4, 1, 64, dtype=torch.float32),
            key=_t(2, 4, 100, 64, dtype=torch.float32, seed=1),
            value=_t(2, 4, 100, 64, dtype=torch.float32, seed=2),
        ),
        lambda c: c.Lq <= 8 and c.Lk % 32 != 0 and _decode_kernel_dims(c.E) and c.attn_mask is None,
        ["2.9.1"],
        "2.10.0",
    ),
    "163597-noncontiguous-query-decode": Case(
        lambda: _transposed_query(1),
        lambda c: not c.query.is_contiguous() and 2 <= c.Lq <= 8 and _decode_kernel_dims(c.E),
        ["2.8.0"],
        "2.9.1",
    ),
    "181133-noncontiguous-query-batch": Case(
        lambda: _transposed_query(2),
        lambda c: not c.query.is_contiguous() and c.query.shape[0] > 1 and 2 <= c.Lq <= 8 and _decode_kernel_dims(c.E),
        ["2.9.1", "2.10.0", "2.11.0", "2.12.1"],
        "2.13.0",
    ),
    "176767-value-head-dim": Case(
        lambda: dict(query=_t(1, 2, 20, 32), key=_t(1, 2, 24, 32, seed=1), value=_t(1, 2, 24, 16, seed=2)),
        lambda c: c.value.shape[-1] != c.E,
        ["2.9.1", "2.10.0", "2.11.0"],
        "2.12.1",
    ),
    "195910-causal-half-prefill": Case(
        lambda: _causal_prefill(64),
        lambda c: c.is_causal and c.query.dtype in HALF and c.Lq > 8,
        ["2.10.0", "2.11.0", "2.12.1"],
        "2.13.0",
    ),
    "184122-explicit-scale": Case(
        lambda: dict(query=_t(1, 2, 30, 40), key=_t(1, 2, 50, 40, seed=1), value=_t(1, 2, 50, 40, seed=2), scale=0.3),
        lambda c: c.scale is not None,
        ["2.9.1", "2.10.0", "2.11.0", "2.12.1"],
        "2.13.0",
    ),
}


def _run(kw: Dict[str, Any]) -> torch.Tensor:
    kw = dict(kw)
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    return subquad.sdpa(q, k, v, **kw)


def _golden(kw: Dict[str, Any]):
    kw = dict(kw)
    q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
    return naive_attention(*to64(q, k, v), **kw), naive_attention(q, k, v, **kw)


@pytest.mark.parametrize("name", list(CASES))
def test_no_call_in_a_defects_condition_reaches_torch_on_its_releases(mps, name):
    case = CASES[name]
    for version in case.affected:
        kw = case.make()
        mps.at(version)
        out = _run(kw)
        bad = [c for c in mps.calls if case.meets(c)]
        assert not bad, f"torch {version} got a call in the condition of pytorch#{name}"
        assert_close_to_golden(out, *_golden(kw))


@pytest.mark.parametrize("name", list(CASES))
def test_a_release_without_the_defect_gets_the_call_unchanged(mps, name):
    case = CASES[name]
    kw = case.make()
    mps.at(case.fixed)
    out = _run(kw)
    assert any(case.meets(c) for c in mps.calls), f"torch {case.fixed} should get the call as it is ({name})"
    assert_close_to_golden(out, *_golden(kw))


def test_the_condition_met_is_the_path_torch_takes(mps):
    # The cases above meet their defect where torch's own dispatch sends them (the router says
    # which path): a case that never reached the faulty kernel would test nothing.
    expected = {
        "174861-two-pass-decode-half": ("2.10.0", "decode-2pass"),
        "169222-decode-keys-not-multiple-of-32": ("2.9.1", "decode-1pass"),
        "181133-noncontiguous-query-batch": ("2.11.0", "decode-1pass"),
        "195910-causal-half-prefill": ("2.12.1", "mpsgraph"),
    }
    for name, (version, path) in expected.items():
        kw = CASES[name].make()
        inp = Inputs(
            kw["query"],
            kw["key"],
            kw["value"],
            (kw["query"].shape[0],),
            None,
            kw.get("is_causal", False),
            kw["query"].shape[-1] ** -0.5,
            0.0,
            batch=kw["query"].shape[0],
        )
        r = mps_sdpa.route(inp, version, mpp=False)
        taken = mps_sdpa.torch_path(mps_sdpa.Call.of(inp), mps_sdpa.release(version))
        assert taken.name == path and r.detours, (name, taken, r)


def test_an_ordinary_half_precision_decode_step_still_goes_to_torch(mps):
    # A KV cache of 2048 keys, one query: torch 2.11 on has the two-pass kernel right.
    for version in ("2.11.0", "2.12.1", "2.13.0", "2.14.1"):
        kw = _two_pass_half()
        mps.at(version)
        out = _run(kw)
        assert len(mps.calls) == 1 and mps.calls[0].attn_mask is None and mps.calls[0].scale is None, version
        assert_close_to_golden(out, *_golden(kw))


def test_mpsgraph_never_gets_an_explicit_scale_even_the_default(mps):
    mps.at("2.12.1")
    q, k, v = _t(1, 2, 30, 40), _t(1, 2, 30, 40, seed=1), _t(1, 2, 30, 40, seed=2)
    subquad.sdpa(q, k, v, scale=40**-0.5)
    subquad.attention(q, k, v)
    assert [c.scale for c in mps.calls] == [None, None]


def test_a_fully_masked_row_before_torch_2_9_runs_in_the_tiles(mps):
    mps.at("2.8.0")
    q, k, v = (
        _t(1, 2, 16, 64, dtype=torch.float32),
        _t(1, 2, 16, 64, dtype=torch.float32, seed=1),
        _t(1, 2, 16, 64, dtype=torch.float32, seed=2),
    )
    mask = torch.ones(16, 16, dtype=torch.bool)
    mask[3] = False
    plan = subquad.explain(q, k, v, attn_mask=mask)
    assert plan.backend != "sdpa" and any("pytorch#156707" in r for r in plan.rejected["sdpa"]), str(plan)
    out = subquad.sdpa(q, k, v, attn_mask=mask)
    assert not mps.calls and torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))


def test_a_bool_mask_through_the_float32_detour_keeps_its_meaning(mps):
    # 2.9's decode kernels read past 100 keys: the mask goes to MPSGraph as float32, -inf where False.
    mps.at("2.9.1")
    q, k, v = _t(2, 4, 3, 64), _t(2, 4, 100, 64, seed=1), _t(2, 4, 100, 64, seed=2)
    mask = torch.rand(2, 1, 3, 100, generator=torch.Generator().manual_seed(5)) > 0.4
    out = subquad.sdpa(q, k, v, attn_mask=mask)
    assert mps.calls and all(c.attn_mask is not None and c.attn_mask.dtype == torch.float32 for c in mps.calls)
    assert_close_to_golden(
        out, naive_attention(*to64(q, k, v), attn_mask=mask), naive_attention(q, k, v, attn_mask=mask)
    )


def test_causal_gradients_through_the_detours_are_exact(mps):
    # With gradients torch takes its composite math path, which has no defect here; a causal
    # call without them takes the explicit mask. Both give float64's gradients.
    mps.at("2.12.1")
    q, k, v = (_t(1, 2, 24, 40, dtype=torch.float32, seed=s).requires_grad_() for s in range(3))
    out = subquad.sdpa(q, k, v, is_causal=True)
    out.sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    naive_attention(q64, k64, v64, is_causal=True).sum().backward()
    for got, want in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------- what the user sees
def test_explain_names_the_detour(mps):
    mps.at("2.12.1")
    q, k, v = (_t(1, 4, 64, 40, seed=s) for s in range(3))
    plan = subquad.explain(q, k, v, is_causal=True)
    assert plan.backend == "sdpa", str(plan)
    text = str(plan)
    assert "torch 2.12.1 on MPS leaks future keys in causal half-precision attention (pytorch#195910)" in text
    assert "an explicit mask instead" in text and "MPSGraph" in text


def test_active_entries_per_release():
    assert [d.issue for d in mps_sdpa.active_defects("2.12.1")] == [181133, 195910, 184122, 179352]
    assert [d.issue for d in mps_sdpa.active_defects("2.13.0")] == [195910, 179352]
    assert 174861 in [d.issue for d in mps_sdpa.active_defects("2.10.0")]
    assert 174861 not in [d.issue for d in mps_sdpa.active_defects("2.11.0")]


def test_subquad_info_on_mps_lists_the_active_entries(monkeypatch, capsys):
    from subquad import _cli

    monkeypatch.setattr(torch, "__version__", TorchVersion("2.12.1"))
    _cli.print_mps_defects()
    text = capsys.readouterr().out
    for issue in (181133, 184122, 195910, 179352):
        assert f"pytorch#{issue}" in text, text
    assert "pytorch#174861" not in text


# ----------------------------------------------------------------- the memory model of each path
def _plan(version, shape, dtype=torch.float16, monkeypatch=None, **kw):
    with fake_tensors():
        q, k, v = (torch.empty(shape, device="mps", dtype=dtype) for _ in range(3))
        return subquad.explain(q, k, v, **kw)


@pytest.mark.parametrize("version", ["2.13.0", "2.14.1"])
def test_prefill_calls_are_not_tiled_for_scores_torch_never_holds(monkeypatch, version):
    # 2**31 scores: over MPSGraph's cap, but the prefill kernel holds none of them.
    device_memory(monkeypatch, mps_recommended=48 * GiB)
    monkeypatch.setattr(torch, "__version__", TorchVersion(version))
    for dtype in (torch.float16, torch.float32):
        plan = _plan(version, (1, 8, 16384, 128), dtype)
        assert plan.backend == "sdpa" and plan.chunk_size is None, str(plan)
        assert plan.predicted_peak_bytes < 64 << 20, str(plan)
        assert "prefill kernel" in str(plan)


def test_mpp_prefill_on_2_14_holds_no_scores_either(monkeypatch):
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.14.1"))
    q, k = _t(1, 8, 4096, 64), _t(1, 8, 4096, 64, seed=1)
    inp = Inputs(q, k, k, (1,), None, False, 64**-0.5, 0.0)
    r = mps_sdpa.route(inp, mpp=True)
    assert r.path is mps_sdpa.MPP and mps_sdpa.path_bytes(inp, r.path) == 0
    assert mps_sdpa.route(inp, "2.13.0", mpp=True).path is mps_sdpa.PREFILL


@pytest.mark.parametrize("version", ["2.12.1", "2.13.0", "2.14.1"])
@pytest.mark.parametrize("E", [40, 80, 160, 512], ids=lambda e: f"E{e}")
def test_stable_diffusions_head_dims_go_to_mpsgraph_which_holds_the_scores(monkeypatch, version, E):
    device_memory(monkeypatch, mps_recommended=48 * GiB)
    monkeypatch.setattr(torch, "__version__", TorchVersion(version))
    B, H, L = 2, 8, 4096
    if E != 160:  # prefill's head dims exclude 40, 512; 80 is one from 2.13 on
        plan = _plan(version, (B, H, L, E))
        if E == 80 and version >= "2.13":
            assert plan.predicted_peak_bytes < B * H * L * L, str(plan)
        else:
            assert plan.predicted_peak_bytes >= B * H * L * L * 8, str(plan)
    # and calls over the cap go to the tiles on MPSGraph
    plan = _plan(version, (2, 8, 16384, E))
    if E == 80 and version >= "2.13":
        assert plan.backend == "sdpa", str(plan)
    else:
        assert plan.backend != "sdpa" and any("pytorch#179352" in r for r in plan.rejected["sdpa"]), str(plan)


def test_the_fast_path_rechecks_the_route_at_a_new_length(mps, monkeypatch):
    # Remembered for a short call, a longer one must not carry past MPSGraph's cap into torch.
    mps.at("2.12.1")
    monkeypatch.setattr(backends_base, "MPS_MAX_MATMUL_ELEMENTS", 2 * 64 * 64)
    short = [_t(1, 2, 32, 40, seed=s) for s in range(3)]
    subquad.sdpa(*short)
    subquad.sdpa(*short)
    assert len(mps.calls) == 2
    long_ = [_t(1, 2, 96, 40, seed=s) for s in range(3)]
    out = subquad.sdpa(*long_)
    assert len(mps.calls) == 2, "2*96*96 scores are over the cap: the tiles must run them"
    assert_close_to_golden(out, naive_attention(*to64(*long_)), naive_attention(*long_))


def test_cpu_and_cuda_never_take_the_route(monkeypatch):
    calls = []
    monkeypatch.setattr(mps_sdpa, "route", lambda *a, **k: calls.append(a) or None)
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.10.0"))
    q, k, v = (_t(1, 4, 40, 64, dtype=torch.float32, seed=s) for s in range(3))
    subquad.sdpa(q, k, v, is_causal=True)
    subquad.explain(q, k, v, is_causal=True, backend="sdpa")
    as_device(monkeypatch, "cuda")
    device_memory(monkeypatch, cuda_free=40 * GiB)
    with fake_tensors():
        fq = torch.empty(1, 4, 40, 64, device="cuda", dtype=torch.float16)
        subquad.explain(fq, fq, fq, is_causal=True)
    assert not calls


# ----------------------------------------------------------------- ComfyUI's calls on a Mac
@pytest.mark.parametrize("version", ["2.10.0", "2.12.1"])
def test_comfyui_attention_on_simulated_mps_goes_through_the_router(mps, version):
    from subquad.integrations.comfyui import _attention as comfy

    mps.at(version)
    # SD1.5's self- and cross-attention (8 heads of 40), fp16, in ComfyUI's [B, L, H*D] layout
    q = _t(2, 256, 320)
    for k in (_t(2, 256, 320, seed=1), _t(2, 77, 320, seed=2)):
        out = comfy.attention(q, k, k, heads=8, attn_precision=torch.float32)
        qh, kh = (t.unflatten(-1, (8, -1)).transpose(1, 2) for t in (q, k))
        want = naive_attention(*to64(qh, kh, kh)).transpose(1, 2).flatten(2)
        ref = naive_attention(qh, kh, kh).transpose(1, 2).flatten(2)
        assert_close_to_golden(out, want, ref)
    # the VAE's single head of 512 channels
    x = _t(1, 512, 8, 8, seed=3)
    out = comfy.vae_attention(x, x, x)
    xh = x.reshape(1, 1, 512, -1).transpose(2, 3)
    want = naive_attention(*to64(xh, xh, xh)).transpose(2, 3).reshape(x.shape)
    assert_close_to_golden(out, want, naive_attention(xh, xh, xh).transpose(2, 3).reshape(x.shape))
    assert len(mps.calls) == 3
    assert all(c.scale is None and not c.is_causal for c in mps.calls)


def test_comfyuis_upcast_on_mps_reaches_torch_in_float32(mps, monkeypatch):
    # MPSGraph rounds q·kᵀ to float16 (65504 at most): scores of 3e5 overflow to inf there. The
    # upcast ComfyUI asks for (attn_precision=float32) runs the call in float32.
    from subquad.integrations.comfyui import _attention as comfy

    monkeypatch.setattr(comfy, "_on_mps", lambda t: True)
    mps.at("2.12.1")
    q = torch.full((1, 16, 80), 20.0, dtype=torch.float16)
    k = _t(1, 16, 80, seed=1).abs() * 30
    out = comfy.attention(q, k, k, heads=1, attn_precision=torch.float32)
    assert [c.query.dtype for c in mps.calls] == [torch.float32] and out.dtype == torch.float16
    want = naive_attention(*to64(q[:, None], k[:, None], k[:, None]))[:, 0]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=1e-3)
    mps.calls.clear()
    comfy.attention(q, k, k, heads=1)  # no upcast asked: the call goes as it is
    assert [c.query.dtype for c in mps.calls] == [torch.float16]
