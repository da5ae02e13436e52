"""The CUDA and MPS paths, simulated on a machine without them (issue 27; tests/_devices.py).

Each test here states a defect found by reading those paths, and fails on the code that had it:
half-precision scores, the MPS matmul cap that aborts the process, MPS out-of-memory texts, SDPA's
NaN rows on older torch, and the per-process memory cap on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from torch.torch_version import TorchVersion

import subquad
from _devices import OpRecorder, as_device, device_memory, fake_tensors
from conftest import assert_close_to_golden, float32_scores_reference, naive_attention, to64
from subquad import _fast
from subquad._backends import BACKENDS, MPS_MAX_MATMUL_ELEMENTS
from subquad._backends import base as backends_base
from subquad._backends import matmul as matmul_module
from subquad._budget import free_memory_bytes, resolve_budget
from subquad._tiles import is_oom

GiB = 1 << 30
HALF = [torch.float16, torch.bfloat16]


# ----------------------------------------------------------------- half precision off the CPU
@pytest.mark.parametrize("device", ["cuda", "mps"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_precision_tiles_are_as_exact_as_sdpa_on_every_device(monkeypatch, device, dtype):
    # Before: off the CPU the tiles' bmm wrote fp16/bf16 scores; on test_gpu.py's inputs the error
    # against float64 was 0.046 (fp16) and 0.338 (bf16), against SDPA's 0.004 and 0.031.
    as_device(monkeypatch, device)
    g = torch.Generator().manual_seed(0)
    q, k, v = ((torch.randn(2, 4, 300, 64, generator=g) * 3).to(dtype) for _ in range(3))
    with OpRecorder() as rec:
        out = subquad.attention(q, k, v, backend="matmul", chunk_size=(64, 96))
    golden = naive_attention(*to64(q, k, v))
    assert_close_to_golden(out, golden, float32_scores_reference(q, k, v))
    products = rec.named("aten.bmm", "aten.baddbmm")
    assert products, "the call ran no matmul"
    assert {op.out_dtypes for op in products} == {(torch.float32,)}, {op.out_dtypes for op in products}


@pytest.mark.parametrize("device", ["cuda", "mps"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_precision_tile_gradients_use_float32_products(monkeypatch, device, dtype):
    as_device(monkeypatch, device)
    g = torch.Generator().manual_seed(1)
    q, k, v = ((torch.randn(1, 2, 70, 32, generator=g) * 3).to(dtype).requires_grad_() for _ in range(3))
    out = subquad.attention(q, k, v, backend="matmul", chunk_size=(32, 48))
    d_out = torch.randn(out.shape, generator=g).to(dtype)
    with OpRecorder() as rec:
        grads = torch.autograd.grad(out, (q, k, v), d_out)
    assert {op.out_dtypes for op in rec.named("aten.bmm", "aten.baddbmm")} == {(torch.float32,)}
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    golden = torch.autograd.grad(naive_attention(q64, k64, v64), (q64, k64, v64), d_out.double())
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    reference = torch.autograd.grad(naive_attention(q32, k32, v32), (q32, k32, v32), d_out.float())
    for name, got, gold, ref in zip("qkv", grads, golden, reference):
        assert_close_to_golden(got, gold, ref.to(dtype), name=f"d{name}")


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("case", ["plain", "alibi-causal", "float-mask", "dropout"])
def test_cuda_half_tiles_multiply_half_operands_into_float32(monkeypatch, dtype, case):
    # CUDA (torch 2.8 on) writes float32 results from half operands in one GEMM; there the tiles
    # keep q, k, v, P and dS in half precision. The GEMM is emulated here by its definition (exact
    # products of the half operands, float32 accumulation); every product of the forward and the
    # backward must take it, and the results stay as exact as the float32 products'.
    as_device(monkeypatch, "cuda")
    monkeypatch.setattr(matmul_module, "widening_products", lambda device: True)
    seen = []
    product = matmul_module.product

    def widening(a, b, out, alpha=1.0):
        seen.append((a.dtype, b.dtype, out.dtype))
        if a.dtype == out.dtype:
            return product(a, b, out, alpha)
        return torch.baddbmm(out, a.float(), b.float(), beta=0.0, alpha=alpha, out=out)

    monkeypatch.setattr(matmul_module, "product", widening)
    g = torch.Generator().manual_seed(4)
    q, k, v = ((torch.randn(1, 4, 90, 59, generator=g) * 3).to(dtype) for _ in range(3))
    kw: dict = {}
    if case == "alibi-causal":
        slopes = subquad.mods.alibi_slopes(4)
        kw = dict(score_mod=lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki), mask_mod=lambda b, h, qi, ki: ki <= qi)
    elif case == "float-mask":
        kw = dict(attn_mask=torch.randn(90, 90, generator=g).to(dtype))
    elif case == "dropout":
        kw = dict(dropout_p=0.3)  # the same masks in every dtype from the same seed
    d_out = torch.randn(1, 4, 90, 59, generator=g).to(dtype)

    def grads_of(x, **more):
        x = [t.detach().clone().requires_grad_() for t in x]
        torch.manual_seed(5)
        out = subquad.attention(*x, backend="matmul", chunk_size=(32, 40), **kw, **more)
        return [out, *torch.autograd.grad(out, x, d_out.to(out.dtype))]

    got = grads_of((q, k, v))
    assert seen and set(seen) == {(dtype, dtype, torch.float32)}, set(seen)
    n_wide, seen[:] = len(seen), []
    monkeypatch.setattr(matmul_module, "widening_products", lambda device: False)
    as_float32 = grads_of((q, k, v))  # float32 copies of q, k and v (MPS, older torch)
    # Every product on float32 copies there; per tile, P·V and dQ accumulate in place (baddbmm_)
    # there, so 5 of its 7 products go through product(): all 7 did above.
    assert set(seen) == {(torch.float32, torch.float32, torch.float32)}, set(seen)
    assert 5 * n_wide == 7 * len(seen), (n_wide, len(seen))
    want = grads_of(to64(q, k, v))
    for name, a, gold, b in zip(("output", "dq", "dk", "dv"), got, want, as_float32):
        assert a.dtype == dtype
        assert_close_to_golden(a, gold, b, name=name)


def test_widening_products_are_probed_and_refused_where_they_do_not_work(monkeypatch):
    from subquad._backends import products

    assert not products.widening_products(torch.device("cpu"))  # CPUs: the bf16 products instead
    assert not products.widening_products(torch.device("mps"))  # until a Mac checks the rounding
    assert not products._widening_works(torch.device("cpu"))  # no such kernel: refused, not raised
    real = torch.baddbmm

    def widening(c, a, b, *, beta, alpha, out_dtype, out):  # the GEMM by its definition
        return real(c, a.to(out_dtype), b.to(out_dtype), beta=beta, alpha=alpha, out=out)

    monkeypatch.setattr(torch, "baddbmm", widening)
    assert products._widening_works(torch.device("cpu"))
    # One that ignores alpha, and one that adds what the buffer held (NaN) despite beta=0.
    monkeypatch.setattr(torch, "baddbmm", lambda c, a, b, **kw: widening(c, a, b, **{**kw, "alpha": 1.0}))
    assert not products._widening_works(torch.device("cpu"))
    monkeypatch.setattr(torch, "baddbmm", lambda c, a, b, **kw: widening(c, a, b, **{**kw, "beta": 1.0}))
    assert not products._widening_works(torch.device("cpu"))


# ----------------------------------------------------------------- MPS: the per-matmul element cap
@pytest.mark.parametrize(
    "shape,recommended",
    [((1, 8, 16384, 128), 48 * GiB), ((1, 5, 16384, 128), 21 * GiB), ((2, 16, 8192, 64), 64 * GiB)],
    ids=["48GiB", "21GiB", "batch2-64GiB"],
)
def test_mps_never_plans_a_matmul_over_the_element_cap(monkeypatch, shape, recommended):
    # Before: SDPA (which on MPS materializes the scores) was planned for 2**31 scores; Metal
    # aborts such a call (SIGABRT, pytorch#149261) and no except can catch it. Torch 2.12 runs
    # every call of over 8 queries on MPSGraph (2.13's prefill kernel holds no scores:
    # tests/test_mps_router.py).
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.12.1"))
    device_memory(monkeypatch, mps_recommended=recommended)
    with fake_tensors():
        q, k, v = (torch.empty(shape, device="mps") for _ in range(3))
        plan = subquad.explain(q, k, v)
    assert plan.backend != "sdpa", str(plan)
    assert any("2^30" in r or f"{MPS_MAX_MATMUL_ELEMENTS:,}" in r for r in plan.rejected["sdpa"]), str(plan)
    B, H = shape[:2]
    assert plan.chunk_size is not None and B * H * plan.chunk_size[0] * plan.chunk_size[1] < MPS_MAX_MATMUL_ELEMENTS


def test_mps_still_plans_sdpa_below_the_cap(monkeypatch):
    device_memory(monkeypatch, mps_recommended=48 * GiB)
    with fake_tensors():
        q, k, v = (torch.empty(1, 8, 4096, 64, device="mps") for _ in range(3))
        assert subquad.explain(q, k, v).backend == "sdpa"


def test_mps_tiles_are_refused_when_even_the_smallest_exceed_the_cap(monkeypatch):
    # Before: the tile search found no candidate and failed with an IndexError.
    device_memory(monkeypatch, mps_recommended=48 * GiB)
    monkeypatch.setattr(backends_base, "MPS_MAX_MATMUL_ELEMENTS", 1 << 10)
    with fake_tensors():
        q, k, v = (torch.empty(2, 64, 128, 16, device="mps") for _ in range(3))
        with pytest.raises(NotImplementedError, match="even its smallest tiles"):
            subquad.explain(q, k, v, backend="matmul")


def test_mps_fast_path_rechecks_the_cap_when_the_lengths_grow(monkeypatch):
    # A plan remembered for a short call must not carry a longer one past the cap into SDPA.
    as_device(monkeypatch, "mps")
    device_memory(monkeypatch, mps_recommended=48 * GiB)
    cap = 64 * 64 * 2
    monkeypatch.setattr(backends_base, "MPS_MAX_MATMUL_ELEMENTS", cap)
    _fast._CACHE.clear()
    ran = []
    real = BACKENDS["sdpa"].run_whole
    monkeypatch.setattr(BACKENDS["sdpa"], "run_whole", lambda inp, need_lse=False: ran.append(inp.Lk) or real(inp))
    short = [torch.randn(1, 2, 32, 16) for _ in range(3)]
    subquad.sdpa(*short, memory_budget="1GiB")
    subquad.sdpa(*short, memory_budget="1GiB")
    assert ran == [32, 32]  # planned, then through the fast path
    long_ = [torch.randn(1, 2, 96, 16) for _ in range(3)]
    out = subquad.sdpa(*long_, memory_budget="1GiB")
    assert ran == [32, 32], "2*96*96 scores are over the cap: the tiles must run them"
    assert_close_to_golden(out, naive_attention(*to64(*long_)), naive_attention(*long_))


@pytest.mark.parametrize(
    "message",
    [
        "Invalid buffer size: 34.00 GB",
        "MPS backend out of memory (MPS allocated: 17.77 GB, other allocations: 40.00 KB, max allowed: 18.13 GB).",
        "CUDA out of memory. Tried to allocate 2.00 GiB",
    ],
)
def test_device_out_of_memory_texts_are_recognised(message):
    assert is_oom(RuntimeError(message))


def test_a_kernel_refusal_is_not_out_of_memory():
    assert not is_oom(RuntimeError("No available kernel. Aborting execution."))


# ----------------------------------------------------------------- NaN rows on older torch
@pytest.mark.parametrize(
    "device,broken,fixed", [("mps", "2.8.0", "2.9.0"), ("cuda", "2.4.1+cu121", "2.5.0")], ids=["mps", "cuda"]
)
def test_sdpa_is_not_planned_for_masks_where_torch_returns_nan_rows(monkeypatch, device, broken, fixed):
    as_device(monkeypatch, device)
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    mask = torch.ones(16, 16, dtype=torch.bool)
    mask[3] = False  # row 3 sees no key: SDPA must give 0, as the CPU kernel does
    monkeypatch.setattr(torch, "__version__", TorchVersion(broken))
    plan = subquad.explain(q, k, v, attn_mask=mask)
    assert plan.backend != "sdpa" and any("NaN" in r for r in plan.rejected["sdpa"]), str(plan)
    out = subquad.attention(q, k, v, attn_mask=mask)
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    assert_close_to_golden(
        out, naive_attention(*to64(q, k, v), attn_mask=mask), naive_attention(q, k, v, attn_mask=mask)
    )
    monkeypatch.setattr(torch, "__version__", TorchVersion(fixed))
    assert subquad.explain(q, k, v, attn_mask=mask).backend == "sdpa"
    monkeypatch.setattr(torch, "__version__", TorchVersion(broken))
    assert subquad.explain(q, k, v).backend == "sdpa", "without a mask no row can be empty"


# ----------------------------------------------------------------- budgets from the device's memory
def test_cuda_budget_stays_within_the_per_process_memory_fraction(monkeypatch):
    # Before: the budget read the card's free memory and ignored set_per_process_memory_fraction,
    # which ``subquad bench --model --max-memory`` uses, so every capped row ran out of memory.
    device_memory(
        monkeypatch,
        cuda_free=70 * GiB,
        cuda_total=80 * GiB,
        cuda_fraction=0.25,
        cuda_allocated=5 * GiB,
        cuda_reserved=6 * GiB,
    )
    cuda = torch.device("cuda")
    assert free_memory_bytes(cuda) == 20 * GiB - 5 * GiB
    assert resolve_budget(None, cuda) == (15 * GiB) // 2
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0)
    assert free_memory_bytes(cuda) == 70 * GiB + 1 * GiB, "uncapped: free memory plus the allocator's cached blocks"


def test_cuda_plans_against_the_capped_budget(monkeypatch):
    device_memory(monkeypatch, cuda_free=70 * GiB, cuda_total=80 * GiB, cuda_fraction=0.01)
    with fake_tensors():
        q, k, v = (torch.empty(1, 8, 16384, 64, device="cuda") for _ in range(3))
        plan = subquad.explain(q, k, v, backend="matmul")
    assert plan.budget_bytes == int(0.01 * 80 * GiB) // 2
    assert plan.predicted_peak_bytes <= plan.budget_bytes


def test_mps_budget_is_half_of_what_metal_recommends_minus_what_is_allocated(monkeypatch):
    device_memory(monkeypatch, mps_recommended=21 * GiB, mps_allocated=1 * GiB)
    assert resolve_budget(None, torch.device("mps")) == 10 * GiB


# ----------------------------------------------------------------- device -> host syncs
SYNC_CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "bool-mask": {"attn_mask": "bool"},
    "float-mask": {"attn_mask": "float"},
    "dropout": {"dropout_p": 0.1},
    "score_mod": {"score_mod": lambda s, b, h, qi, ki: s * 0.5},
    "mask_mod": {"mask_mod": lambda b, h, qi, ki: ki <= qi},
}


@pytest.mark.parametrize("case", list(SYNC_CASES))
def test_tile_loop_syncs_do_not_grow_with_the_tiles(monkeypatch, case):
    # A GPU waits for the host at every .item()/bool(tensor): one per tile would serialize the
    # tile loop. Dropout draws its seed once per call; nothing else may wait.
    as_device(monkeypatch, "cuda")
    g = torch.Generator().manual_seed(3)
    kw = dict(SYNC_CASES[case])
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(128, 128, generator=g) > 0.3
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(128, 128, generator=g)
    syncs = {}
    for chunk in (64, 32):
        q, k, v = (torch.randn(1, 2, 128, 16, generator=g).requires_grad_() for _ in range(3))
        with OpRecorder() as forward:
            out = subquad.attention(q, k, v, backend="matmul", chunk_size=chunk, **kw)
        with OpRecorder() as backward:
            out.sum().backward()
        syncs[chunk] = (forward.syncs, backward.syncs)
    allowed = 1 if case == "dropout" else 0
    assert syncs[32] == syncs[64] and max(syncs[32]) <= allowed, syncs


def test_ring_parts_read_a_document_mask_once_per_block():
    # subquad.distributed splits each ring block into parts and leaves out those the mask_mod
    # hides; a document mask's ids on a GPU made the host wait once per part.
    from types import SimpleNamespace

    from subquad._inputs import BlockPositions
    from subquad.distributed._ring import Block, block_states_of, split_block

    ids = torch.arange(1024) // 100  # documents of 100 tokens
    mask = subquad.mods.document(ids)
    call = SimpleNamespace(block_states=block_states_of(mask, ids.device))
    block = Block((0, 512), (0, 512), BlockPositions(256, 512, (1024, 1024)), False, None)
    with OpRecorder() as rec:
        parts = list(split_block(call, block, 32, 32))
    assert rec.syncs == 0, rec.summary()
    # Exactly the parts in which some query and key share a document (brute force).
    q_doc, k_doc = ids[256:768], ids[512:1024]
    expected = [
        (r0, c0)
        for r0 in range(0, 512, 32)
        for c0 in range(0, 512, 32)
        if (q_doc[r0 : r0 + 32, None] == k_doc[None, c0 : c0 + 32]).any()
    ]
    assert [(p.q[0], p.kv[0]) for p in parts] == expected
    assert [p.positions.q_offset - 256 for p in parts] == [r0 for r0, _ in expected]


def test_flex_on_cuda_without_triton_is_refused_before_compiling(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    device_memory(monkeypatch, cuda_free=70 * GiB)
    with fake_tensors():
        q, k, v = (torch.empty(1, 8, 4096, 64, device="cuda") for _ in range(3))
        plan = subquad.explain(q, k, v, score_mod=lambda s, b, h, qi, ki: 30 * torch.tanh(s / 30), allow_compile=True)
    assert plan.backend == "matmul", str(plan)
    assert any("Triton is not installed" in r for r in plan.rejected["flex"]), str(plan)


def test_a_fatal_device_error_in_a_fused_kernel_is_not_read_as_a_refusal():
    from subquad._tiles import KernelRefused, call_kernel

    def broken(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def refusing(*args):
        raise RuntimeError("No available kernel. Aborting execution.")

    with pytest.raises(RuntimeError, match="illegal memory access") as caught:
        call_kernel(broken)
    assert not isinstance(caught.value, KernelRefused)
    with pytest.raises(KernelRefused):
        call_kernel(refusing)


def test_the_gpu_sdpa_probe_times_the_whole_kernel_per_score():
    # On CUDA the planner times torch's SDPA itself (its kernels hold no scores, which the rate
    # probe's softmax passes stream). The probe is device-neutral: here it runs on the CPU.
    from subquad import _time_model

    assert _time_model._SDPA_PROBE_SHAPE[3] == _time_model._CPU_PROBE_SHAPE[3]  # forward_seconds scales from one E
    per_score, per_row = _time_model._measure_whole(torch.device("cpu"), torch.float32, "sdpa")
    assert per_row == 0.0 and 1e-13 < per_score < 1e-6, per_score
    assert _time_model.backend_seconds(torch.device("cpu"), torch.float32, "sdpa") is None  # the CPU: model + fused


def test_cuda_tile_calls_take_at_least_their_python_time_and_overlap_it(monkeypatch):
    # On the H200 a one-tile call of the tiles spent 1.2 ms (forward) and 3.5 ms (with the
    # backward) in Python while the GPU worked 0.46 and 1.42 ms; explain() predicted the GPU's
    # time alone. A call takes the longer of the two; a large call's GPU time is not lengthened.
    from subquad import _time_model

    # The device's work is given (the rates of the machine running this test do not matter).
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    as_device(monkeypatch, "cuda")
    fwd_s, bwd_s = _time_model._CALL_HOST_S["cuda"]
    monkeypatch.setattr(_time_model, "forward_seconds", lambda *a: 1e-6)  # work the device finishes at once
    assert fwd_s <= subquad.explain(q, k, v, backend="matmul").predicted_seconds < fwd_s + 1e-3
    qg = q.clone().requires_grad_()
    assert fwd_s + bwd_s <= subquad.explain(qg, k, v, backend="matmul").predicted_seconds < fwd_s + bwd_s + 1e-3
    monkeypatch.setattr(_time_model, "forward_seconds", lambda *a: 10.0)  # a call the device is busy with
    assert subquad.explain(q, k, v, backend="matmul").predicted_seconds == 10.0
    as_device(monkeypatch, "cpu")  # the CPU runs Python and the work in turn: they add up
    assert subquad.explain(q, k, v, backend="matmul").predicted_seconds > 10.0


def test_cuda_budget_reads_the_allocator_without_flattening_its_statistics(monkeypatch):
    # torch.cuda.memory_allocated/_reserved flatten every statistic (~0.25 ms a call on an H200
    # host, more than SDPA's own time on small calls); the budget reads the nested ones, and the
    # driver's free memory at most every 0.2 s (free + reserved does not move as torch allocates).
    from subquad import _budget

    device_memory(monkeypatch, cuda_free=10 << 30, cuda_allocated=1 << 30, cuda_reserved=3 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: pytest.fail("flattened stats read"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: pytest.fail("flattened stats read"))
    calls = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: calls.append(device) or (10 << 30, 80 << 30))
    cuda = torch.device("cuda", 0)
    assert _budget.free_memory_bytes(cuda) == (10 << 30) + (3 << 30) - (1 << 30)
    # The allocator takes 2 GiB more from the driver for this process: the driver is not asked again.
    stats = {"allocated_bytes": {"all": {"current": 3 << 30}}, "reserved_bytes": {"all": {"current": 5 << 30}}}
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: stats)
    assert _budget.free_memory_bytes(cuda) == (10 << 30) + (3 << 30) - (3 << 30)
    assert calls == [0]


def test_cuda_matmul_tiles_are_large_and_cpu_tiles_stay_in_cache(monkeypatch):
    # A GPU tile costs its launches unless it is large (H200: 1x8x4096x64 bf16, 34 ms in 128 tiles
    # of 256x512, 2.2 ms in one); the CPU's stay near its caches. The budget still bounds both.
    q, k, v = (torch.randn(1, 8, 4096, 64, dtype=torch.bfloat16) for _ in range(3))
    cpu = subquad.explain(q, k, v, backend="matmul", memory_budget="8GiB").chunk_size
    as_device(monkeypatch, "cuda")
    cuda = subquad.explain(q, k, v, backend="matmul", memory_budget="8GiB").chunk_size
    assert cuda[0] * cuda[1] >= 16 * cpu[0] * cpu[1], (cuda, cpu)
    assert cuda[0] * cuda[1] * 8 * 4 <= backends_base.ACCELERATOR_TILE_BYTES
    small = subquad.explain(q, k, v, backend="matmul", memory_budget="64MiB")
    assert small.chunk_size[0] * small.chunk_size[1] < cuda[0] * cuda[1] and small.predicted_peak_bytes <= 64 << 20


@pytest.mark.parametrize(
    "choice,contexts", [(1, 0), (3, 0), (0, 1), (None, 1)], ids=["flash", "cudnn", "math", "unknown"]
)
def test_cuda_sdpa_restricts_the_kernels_only_where_torch_would_not_take_a_fused_one(monkeypatch, choice, contexts):
    # sdpa_kernel and a warnings filter cost 60-100 us a call on an H200 host; they are needed only
    # where torch's own choice (torch._fused_sdp_choice) is its math fallback or cannot be asked.
    import torch.nn.attention as attention

    entered = []
    real = attention.sdpa_kernel
    monkeypatch.setattr(attention, "sdpa_kernel", lambda *a, **kw: entered.append(a) or real(*a, **kw))

    def chooser(*args, **kwargs):
        if choice is None:
            raise TypeError("unexpected keyword argument")
        return choice

    monkeypatch.setattr(torch, "_fused_sdp_choice", chooser)
    as_device(monkeypatch, "cuda")
    q, k, v = (torch.randn(1, 2, 64, 16, dtype=torch.float64) for _ in range(3))
    out, _ = BACKENDS["sdpa"].run_whole(subquad._inputs.Inputs(q, k, v, (1,), None, False, 0.25, 0.0), False)
    assert len(entered) == contexts
    assert torch.allclose(out, naive_attention(q, k, v, scale=0.25))
