"""The loops' fallback from ATen's micro-kernels to their own (issue 56, item 3).

Where ATen's ``cpublas::brgemm`` throws in the middle of a call (oneDNN refusing a product's shape
on some CPU), ``_native_tiles.cpp`` catches it, runs that product and every later one on the loops'
own micro-kernels and clears the products switch (``aten_products_failed``). Nothing on a CPU that
oneDNN serves makes it refuse, so the kernel's test hook ``_fail_aten_products(n)`` makes the next
``n`` of ATen's products throw just before they run. With the session's build, ATen's products
switched on and the hook armed before the forward or before the backward: the output and the
gradients of q, k and v match the float64 golden (the suite's tolerance policy), the hook fired,
the switch reads ``"own"`` afterwards, and later calls run and match too. Skipped where the kernel
cannot be built, lacks the loop or the hook, or ATen's micro-kernels do not run here.
"""

from __future__ import annotations

from typing import Tuple

import pytest
import torch

import subquad
import test_native
from subquad._backends import calibration
from test_loop_products import products_both_ways  # noqa: F401  (a fixture)
from test_native_loop_mods import LOOPS, _check, _inputs, two_threads  # noqa: F401  (a fixture)

pytestmark = test_native.pytestmark  # a C++ compiler and ninja

CASES = [
    "ALiBi, causal, head dim 59",  # 333 rows and keys: no block of rows or keys is whole
    "ALiBi, GQA 8/2, head dim 111, slopes of one sign and another",
    "sliding window 5 in segments of 48 x 100",  # several calls of the loops per pass
]


@pytest.fixture
def refusing(products_both_ways):  # noqa: F811  (the fixture imported above)
    """The session's build with its loops' calls recorded (``Counting``); disarms the hook
    afterwards (``products_both_ways`` restores what the loops multiplied on)."""
    real, counting = products_both_ways
    if not hasattr(real, "_fail_aten_products"):
        pytest.skip("the native kernel was built without the products' test hook")
    yield real, counting
    real._fail_aten_products(0)


def _run(name: str, dtype: torch.dtype, armed: str, real, n: int) -> Tuple[torch.Tensor, ...]:
    """One forward and backward of case ``name`` through the loops, the hook armed with ``n``
    before the pass ``armed``; checked against float64. Returns the output and the gradients."""
    q, k, v, d_out, kw, chunk = _inputs(name, dtype, 11)
    if armed == "forward":
        real._fail_aten_products(n)
    out = subquad.attention(q, k, v, backend="loops", chunk_size=chunk, **kw)
    if armed == "backward":
        real._fail_aten_products(n)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    _check(q, k, v, d_out, out, grads, kw)
    return (out, *grads)


@pytest.mark.parametrize("n", [1, 5], ids=lambda n: f"{n} refused")
@pytest.mark.parametrize("armed", ["forward", "backward"])
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("name", CASES)
def test_a_refused_product_falls_back_to_the_loops_own(refusing, two_threads, dtype, armed, n, name):  # noqa: F811
    real, counting = refusing
    which = calibration.products_of(dtype)
    if not real.aten_products_work(which):
        pytest.skip(f"ATen's micro-kernels do not run the {which} products here")
    suffix = LOOPS[dtype]
    if not hasattr(real, f"backward_segment_{suffix}"):
        pytest.skip(f"the native kernel was built without the {suffix} loops")
    real.set_products(which, True)
    assert real.products(which) == "aten"
    first = _run(name, dtype, armed, real, n)
    assert set(counting.names) == {f"forward_segment_{suffix}", f"backward_segment_{suffix}"}, counting.names
    left = real._fail_aten_products(0)
    # Each thread of the pass takes at most one refusal: its later products run on the loops' own.
    assert n - torch.get_num_threads() <= left < n, (n, left)
    assert real.products(which) == "own", "the switch is cleared after a refused product"
    assert real.products("float32" if which == "bfloat16" else "bfloat16") == "own"
    # Later calls run on the loops' own products and give the same results.
    counting.calls.clear()
    again = _run(name, dtype, "neither", real, 0)
    assert set(counting.names) == {f"forward_segment_{suffix}", f"backward_segment_{suffix}"}, counting.names
    for a, b in zip(first, again):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)


def test_the_hook_counts_down_and_refuses_a_negative_count(refusing):
    real, _ = refusing
    assert real._fail_aten_products(3) == 0
    assert real._fail_aten_products(0) == 3  # nothing multiplied in between: all three still armed
    with pytest.raises(RuntimeError, match="n: how many of ATen's products to refuse"):
        real._fail_aten_products(-1)
