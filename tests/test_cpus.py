"""The choices that depend on the CPU, made on every kind of CPU (tests/_machine.py ``MACHINES``).

Each test states the machine it assumes by faking torch's feature probes, the float16 GEMMs'
verdict and what ``subquad build`` gives there (``fake_cpu``; the kernel a stand-in whose
functions must not run: these tests plan, they do not compute), so every branch is tested on
every machine this suite runs on, with a compiler or without. The kernel's own results are
tested where it is built (tests/test_native*.py); the plans on the CPU the suite happens to run
on, under each machine again, by ``.ci/robustness`` (``SUBQUAD_TEST_CPU``).
"""

from __future__ import annotations

import pytest
import torch

import subquad
from _machine import MACHINES, fake_cpu
from subquad import _time_model
from subquad._backends import fused, matmul, products, segments
from subquad._validate import make_inputs

BF16, F32, F16 = torch.bfloat16, torch.float32, torch.float16

LOOPS_BUILT_FOR = {
    BF16: {"amx", "avx512-bf16"},  # AVX512-BF16 at build time
    F32: {"amx", "avx512-bf16", "avx512f", "avx2"},  # AVX512F, or AVX2 with FMA
    F16: {"amx", "avx512-bf16", "avx512f", "avx2"},
}
"""The machines whose build has the dtype's loops (``no-compiler`` has no build)."""

AUTO_TAKES_LOOPS = {
    BF16: {"avx512-bf16"},  # AMX: torch's kernel multiplies bfloat16 on AMX tiles
    F32: {"avx512-bf16", "avx512f"},  # AVX2's 8 lanes: the loops serve backend="matmul" only
    F16: {"avx512-bf16", "avx512f"},
}
"""Where ``auto`` puts the loops before the fused kernel, for the calls large enough."""


@pytest.fixture(params=list(MACHINES))
def machine(request, monkeypatch, fixed_rates):
    """Each kind of CPU in turn, its build a stand-in; two threads (the backward loop wants a task
    per thread); the time model's rates fixed."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    fake_cpu(monkeypatch, request.param, kernel="stub")
    return request.param


def _took(plan):
    """``"loops"`` for the C++ loops before the fused kernel, else the backend's name."""
    if plan.backend == "matmul" and any("in C++" in note for note in plan.notes):
        return "loops"
    return plan.backend


def _call(shape, dtype, grad=False, keys=None, **kw):
    q = torch.empty(shape, dtype=dtype, requires_grad=grad)
    kv = q if keys is None else torch.empty(shape[:2] + (keys, shape[-1]), dtype=dtype, requires_grad=grad)
    return (q, kv, kv), kw


# Calls large enough for the loops where auto takes them: (shape, keys or None, grad).
LARGE = {
    "inference": ((1, 8, 1024, 64), None, False),  # 2^23 scores
    "training": ((1, 8, 1024, 64), None, True),  # both loops: a task per thread
    "stable-diffusion-self": ((2, 8, 4096, 40), None, False),
    "llm-prefill-causal": ((1, 8, 2048, 64), None, False),
}


@pytest.mark.parametrize("dtype", [BF16, F32, F16], ids=str)
@pytest.mark.parametrize("case", list(LARGE))
def test_auto_takes_the_loops_only_where_they_were_chosen(machine, case, dtype):
    shape, keys, grad = LARGE[case]
    args, kw = _call(shape, dtype, grad, keys, is_causal=case.endswith("causal"))
    want = "loops" if machine in AUTO_TAKES_LOOPS[dtype] else "fused"
    plan = subquad.explain(*args, **kw)
    assert _took(plan) == want, (machine, plan)
    if want == "loops" and grad:
        assert any("forward and backward loops" in n for n in plan.notes), plan


# Calls auto leaves to the fused kernel on every machine, with the reason: (shape, dtype, keys, grad, mask).
SMALL_OR_ODD = {
    "bf16-2^17-scores": ((1, 8, 128, 64), BF16, None, False),  # the fused kernel is faster
    "f32-2^21-scores": ((1, 8, 512, 64), F32, None, False),
    "f32-77-keys": ((4, 10, 4096, 64), F32, 77, False),  # float32 needs a block of 512 keys
    "f32-vae-head-512": ((1, 1, 4096, 512), F32, None, False),  # a head wider than 384
    "bf16-one-task-training": ((1, 1, 4096, 64), BF16, None, True),  # one task for two threads
}


@pytest.mark.parametrize("case", list(SMALL_OR_ODD))
def test_auto_leaves_small_and_odd_calls_to_the_fused_kernel(machine, case):
    shape, dtype, keys, grad = SMALL_OR_ODD[case]
    args, kw = _call(shape, dtype, grad, keys)
    assert _took(subquad.explain(*args, **kw)) == "fused", machine


@pytest.mark.parametrize("dtype", [BF16, F16], ids=str)
def test_half_precision_at_the_thresholds(machine, dtype):
    # bfloat16 from 2^19 scores, float16 from 2^22 (Stable Diffusion 1.5's cross-attention, 77 keys).
    edge = (1, 8, 256, 64) if dtype == BF16 else (2, 8, 4096, 64)
    args, kw = _call(edge, dtype, keys=None if dtype == BF16 else 77)
    want = "loops" if machine in AUTO_TAKES_LOOPS[dtype] else "fused"
    assert _took(subquad.explain(*args, **kw)) == want


def test_a_learnable_mask_keeps_training_on_the_fused_kernel(machine):
    # The backward loop gives no mask gradient.
    q = torch.empty(1, 8, 1024, 64, dtype=BF16, requires_grad=True)
    mask = torch.zeros(1024, 1024, dtype=BF16, requires_grad=True)
    assert _took(subquad.explain(q, q, q, attn_mask=mask)) == "fused"


@pytest.mark.parametrize("dtype", [BF16, F32], ids=str)
def test_packed_calls_take_the_packed_loop_where_auto_takes_the_loops(machine, dtype):
    lengths = [700, 900, 1000, 800]
    total = sum(lengths)
    q = torch.empty(total, 8, 64, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    plan = subquad.varlen_explain(q, q, q, cu, cu)
    packed = any("packed call's sequences" in n for n in plan.notes)
    assert packed == (machine in AUTO_TAKES_LOOPS[dtype]), (machine, plan)


@pytest.mark.parametrize("dtype", [BF16, F32, F16], ids=str)
def test_a_forced_matmul_backend_runs_whichever_loops_the_build_has(machine, dtype):
    # backend="matmul" takes the build's loops wherever it has them, AMX and 8 lanes included.
    inp = make_inputs(*(torch.empty(1, 8, 1024, 64, dtype=dtype) for _ in range(3)))
    assert (segments.segment_kernel(inp) is not None) == (machine in LOOPS_BUILT_FOR[dtype]), machine


@pytest.mark.parametrize("head_dim", [16, 64])
def test_bfloat16_tiles_multiply_in_bfloat16_where_the_cpu_does(machine, head_dim):
    inp = make_inputs(*(torch.empty(1, 2, 64, head_dim, dtype=BF16) for _ in range(3)))
    native = MACHINES[machine].features.amx_tiles or MACHINES[machine].features.avx512_bf16
    assert products.native_bf16_products() is native
    want = BF16 if native and head_dim >= products.HALF_PRODUCTS_MIN_HEAD_DIM else F32
    assert matmul.Matmul.compute_dtype(inp) == want
    # The time model times the GEMMs the call runs, and the fused kernel's tiles keep bfloat16
    # gradients where the CPU multiplies them natively.
    assert _time_model._rates_dtype(torch.device("cpu"), BF16) == (BF16 if native else F32)
    assert fused._tiles_in_float32(inp) is (not native)


def test_float16_runs_on_float32_copies_where_its_gemms_are_emulated(machine):
    inp = make_inputs(*(torch.empty(1, 2, 64, 64, dtype=F16) for _ in range(3)))
    emulated = not MACHINES[machine].fp16_products
    assert fused.emulated_half_kernel(inp) is emulated
    assert matmul.Matmul.compute_dtype(inp) == F32  # the tiles' half products: CUDA only


def test_every_machine_states_a_consistent_build():
    # The tables above describe these machines; a new machine is added to them too.
    for name, m in MACHINES.items():
        built = set() if m.build is None else m.build
        for dtype, where in LOOPS_BUILT_FOR.items():
            loop = "forward_segment_bf16" if dtype == BF16 else "forward_segment_f32"
            assert (loop in built) == (name in where), (name, dtype)
        assert (m.float_lanes > 0) == ("forward_segment_f32" in built), name
        for where in AUTO_TAKES_LOOPS.values():
            assert where <= set(MACHINES)
