"""subquad under torch.compile: the subquad::attention operator (opcheck) and compiled calls.

Golden: PyTorch's SDPA in float64 (eager). Under test: subquad through the operator, compiled
with ``fullgraph=True`` (no graph break allowed), forced into many tiles.
"""

import pytest
import torch
import torch.nn.functional as F

import subquad
from subquad.integrations.compile import attention_backward_op, attention_op, compiled_attention

MANY_TILES = (7, 5)


def _close(test, golden, *, tol=1e-10, what="output"):
    err = (test - golden).abs().max().item()
    scale = golden.abs().max().item() or 1.0
    assert err <= tol * scale, f"{what}: max abs error {err:.3e} > {tol:.1e} x {scale:.3e}"


def _t(*shape, seed, grad=True, dtype=torch.float64):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return t.requires_grad_(grad)


def _cases():
    q = _t(2, 4, 13, 16, seed=0)
    k, v = _t(2, 4, 11, 16, seed=1), _t(2, 4, 11, 8, seed=2)
    kg, vg = _t(2, 2, 11, 16, seed=3), _t(2, 2, 11, 16, seed=4)
    bool_mask = torch.rand(2, 1, 13, 11, generator=torch.Generator().manual_seed(5)) > 0.3
    float_mask = _t(1, 4, 13, 11, seed=6)
    # (query, key, value, attn_mask, is_causal, scale, enable_gqa, memory_budget, chunk_size, backend)
    return {
        "plain-Ev8": (q, k, v, None, False, None, False, None, list(MANY_TILES), "auto"),
        "causal-scale-budget": (q, q, q, None, True, 0.3, False, "1048576", None, "auto"),
        "gqa-bool-mask-matmul": (q, kg, vg, bool_mask, False, None, True, None, list(MANY_TILES), "matmul"),
        "float-mask-with-grad": (q, k, v, float_mask, False, None, False, "1MiB", list(MANY_TILES), "auto"),
        "3d-no-batch": (q[0], k[0], v[0], None, False, None, False, None, [4, 4], "auto"),
    }


CASES = _cases()


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_opcheck(case):
    torch.library.opcheck(attention_op, CASES[case])


def test_opcheck_backward_operator():
    q, k, v = _t(2, 4, 13, 16, seed=0), _t(2, 4, 11, 16, seed=1), _t(2, 4, 11, 8, seed=2)
    out, lse = attention_op(q, k, v, None, False, None, False, None, list(MANY_TILES), "auto")
    grad = _t(*out.shape, seed=3, grad=False)
    args = (
        grad,
        q.detach(),
        k.detach(),
        v.detach(),
        None,
        out.detach(),
        lse.detach(),
        False,
        None,
        False,
        None,
        list(MANY_TILES),
        "auto",
        False,
        False,
    )
    torch.library.opcheck(attention_backward_op, args)


@pytest.mark.parametrize("case", ["plain-Ev8", "gqa-bool-mask-matmul", "float-mask-with-grad"])
def test_compiled_forward_and_backward_match_sdpa(case):
    q, k, v, mask, causal, scale, gqa, budget, chunk, backend = CASES[case]
    leaves = [t for t in (q, k, v, mask) if t is not None and t.is_floating_point()]

    def fn(q, k, v, mask):
        return compiled_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=gqa,
            memory_budget=budget,
            chunk_size=chunk,
            backend=backend,
        )

    torch._dynamo.reset()
    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v, mask)
    grads = torch.autograd.grad(out.square().sum(), leaves)
    golden = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    golden_grads = torch.autograd.grad(golden.square().sum(), leaves)
    _close(out, golden, what="output")
    for i, (g, r) in enumerate(zip(grads, golden_grads)):
        _close(g, r, tol=1e-9, what=f"gradient of input {i}")


def test_dynamic_shapes_do_not_recompile_per_length():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    fn = torch.compile(
        lambda q: compiled_attention(q, q, q, is_causal=True), backend=counter, fullgraph=True, dynamic=True
    )
    for n in (13, 17, 29):
        q = _t(1, 2, n, 8, seed=n, grad=False)
        _close(fn(q), F.scaled_dot_product_attention(q, q, q, is_causal=True), what=f"length {n}")
    assert counter.frame_count == 1


def test_inductor_forward_and_backward():
    # The operator alone: inductor lowers it to a call of the eager engine, no C++ to build.
    q, k, v = (_t(2, 4, 19, 16, seed=s) for s in range(3))
    torch._dynamo.reset()
    fn = torch.compile(
        lambda q, k, v: compiled_attention(q, k, v, is_causal=True, chunk_size=MANY_TILES), fullgraph=True
    )
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    golden = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    golden_grads = torch.autograd.grad(golden, (q, k, v), torch.ones_like(golden))
    _close(out, golden, what="inductor output")
    for name, g, r in zip("qkv", grads, golden_grads):
        _close(g, r, tol=1e-9, what=f"inductor d{name}")


@pytest.mark.slow
def test_inductor_fuses_around_the_operator():
    # Pointwise ops around the operator become generated C++ (about 25 s of compiling on 2 cores).
    q, k, v = (_t(2, 4, 19, 16, seed=s, grad=False, dtype=torch.float32) for s in range(3))

    def block(q, k, v):
        return (compiled_attention(torch.tanh(q), k, v * 2, is_causal=True, chunk_size=MANY_TILES) + 1).relu()

    torch._dynamo.reset()
    out = torch.compile(block, fullgraph=True)(q, k, v)
    golden = (F.scaled_dot_product_attention(torch.tanh(q), k, v * 2, is_causal=True) + 1).relu()
    _close(out, golden, tol=1e-5, what="inductor output")


def test_subquad_attention_routes_to_the_operator_while_compiling():
    q, k, v = (_t(2, 4, 13, 16, seed=s) for s in range(3))

    def fn(q, k, v):
        out, lse = subquad.attention(q, k, v, is_causal=True, chunk_size=MANY_TILES, return_lse=True)
        return out, lse

    torch._dynamo.reset()
    out, lse = torch.compile(fn, backend="aot_eager", fullgraph=True)(q, k, v)
    eager_out, eager_lse = fn(q, k, v)
    _close(out, eager_out, what="output")
    _close(lse, eager_lse, what="lse")
    assert lse.dtype == torch.float64 and lse.requires_grad == eager_lse.requires_grad  # differentiable, as in eager


def test_callbacks_under_compile_run_eagerly():
    # score_mod/mask_mod are Python callables: they cannot cross the operator boundary, so the
    # call runs subquad's eager engine (with graph breaks) and stays exact.
    q, k, v = (_t(1, 2, 13, 8, seed=s, grad=False) for s in range(3))
    fn = torch.compile(
        lambda q, k, v: subquad.attention(q, k, v, mask_mod=subquad.mods.causal(), chunk_size=MANY_TILES),
        backend="aot_eager",
    )
    torch._dynamo.reset()
    _close(fn(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True), what="mask_mod under compile")


def test_torch_export_keeps_the_operator():
    class Block(torch.nn.Module):
        def forward(self, q, k, v):
            return compiled_attention(q, k, v, is_causal=True, memory_budget="1MiB")

    q, k, v = (_t(1, 2, 13, 8, seed=s, grad=False) for s in range(3))
    program = torch.export.export(Block(), (q, k, v))
    assert "torch.ops.subquad.attention.default" in program.graph_module.code
    _close(program.module()(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True), what="exported")


def test_errors_surface_while_tracing():
    q, k = _t(1, 2, 9, 16, seed=0, grad=False), _t(1, 2, 9, 8, seed=1, grad=False)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"key.shape\[-1\] == query.shape\[-1\]"):
        torch.compile(lambda q, k: compiled_attention(q, k, k), backend="aot_eager", fullgraph=True)(q, k)
    with pytest.raises(TypeError, match="memory_budget"):
        compiled_attention(q, q, q, memory_budget=1.5)
    with pytest.raises(ValueError, match="chunk_size"):
        compiled_attention(q, q, q, chunk_size=(0, 5))
    with pytest.raises(ValueError, match="backend='flash'"):
        compiled_attention(q, q, q, backend="flash")


def test_compiled_lse_is_differentiable():
    q, k, v = _t(1, 2, 10, 8, seed=0), _t(1, 2, 24, 8, seed=1), _t(1, 2, 24, 8, seed=2)

    def merged(q, k, v):
        o1, l1 = compiled_attention(q, k[:, :, :11], v[:, :, :11], chunk_size=(3, 4), return_lse=True)
        o2, l2 = compiled_attention(q, k[:, :, 11:], v[:, :, 11:], chunk_size=(3, 4), return_lse=True)
        lse = torch.logaddexp(l1, l2)
        return o1 * (l1 - lse).exp().unsqueeze(-1) + o2 * (l2 - lse).exp().unsqueeze(-1)

    torch._dynamo.reset()
    out = torch.compile(merged, backend="aot_eager", fullgraph=True)(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    golden = F.scaled_dot_product_attention(q, k, v)
    golden_grads = torch.autograd.grad(golden.square().sum(), (q, k, v))
    _close(out, golden, what="output")
    for g, r in zip(grads, golden_grads):
        _close(g, r, what="grad")
