"""The multi-device checks of subquad.jax (ring, all-to-all, the mesh wrapper), run in one process.

XLA's host devices must be set before JAX is first imported, so tests/test_jax_sharded.py runs this
file as a subprocess (``python tests/_jax_sharded_cases.py``) with four CPU devices; P=2 cases use
a sub-mesh of two. Each case prints one JSON line ``{"case": ..., "ok": ..., "detail": ...}``.

Every case compares each device's output, lse and gradients (of ``sum(out * w) + sum(lse * u)``,
so both cotangents are exercised) with single-device ``subquad.jax.attention`` on the whole
sequence, in float64.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

jax.config.update("jax_enable_x64", True)

import subquad.jax as sj  # noqa: E402

SEQ = P(None, "seq")
RNG = np.random.default_rng(7)
CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def mesh_of(n, explicit=False):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.sharding.Mesh(np.array(jax.devices()[:n]), ("seq",), axis_types=(kind,))


def arrays(B=1, T=32, S=32, N=2, K=2, H=8, Hv=None, dtype=jnp.float64):
    make = lambda *s: jnp.asarray(RNG.standard_normal(s), dtype)  # noqa: E731
    return make(B, T, N, H), make(B, S, K, H), make(B, S, K, Hv or H)


def weights(q, v):
    B, T, N, _ = q.shape
    return jnp.asarray(RNG.standard_normal((B, T, N, v.shape[-1]))), jnp.asarray(RNG.standard_normal((B, T, N)))


def reference(q, k, v, w, u, **options):
    """out, lse and d(sum(out w) + sum(lse u)) / d(q, k, v) of single-device subquad.jax.attention."""

    def loss(q, k, v):
        out, lse = sj.attention(q, k, v, return_lse=True, **options)
        return (out * w).sum() + (lse * u).sum(), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, lse, grads


def sharded(fn, mesh, q, k, v, w, u, layout, extra=()):
    """The same through ``fn(q, k, v, *extra)`` inside shard_map, on the layout's shards, back in global order."""
    n = mesh.devices.size
    to = lambda x: sj.shard(x, n, layout=layout)  # noqa: E731
    back = lambda x: sj.unshard(x, n, layout=layout)  # noqa: E731
    body = jax.shard_map(fn, mesh=mesh, in_specs=(SEQ,) * (3 + len(extra)), out_specs=(SEQ, SEQ))

    def loss(q, k, v, w, u, *extra):
        out, lse = body(q, k, v, *extra)
        return (out * w).sum() + (lse * u).sum(), (out, lse)

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, (out, lse)), grads = run(to(q), to(k), to(v), to(w), to(u), *[to(x) for x in extra])
    return back(out), back(lse), tuple(back(g) for g in grads)


def compare(got, want, tol, what):
    worst = []
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (got[0], got[1], *got[2]), (want[0], want[1], *want[2])):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape, f"{what} {name}: shape {a.shape} != {b.shape}"
        same = (a == b) | (np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b)))
        err = np.where(same, 0.0, np.abs(a - b))
        scale = max(1.0, float(np.nanmax(np.abs(np.where(np.isinf(b), 0, b)))))
        assert not np.isnan(err).any(), f"{what} {name}: NaN"
        worst.append(f"{name} {err.max():.1e}")
        assert err.max() <= tol * scale, f"{what} {name}: max error {err.max():.3e} > {tol * scale:.1e}"
    return ", ".join(worst)


def ring_vs_whole(mesh, layout, q, k, v, tol=1e-10, **options):
    w, u = weights(q, v)
    want = reference(q, k, v, w, u, **options)
    fn = lambda a, b, c: sj.ring_attention(a, b, c, axis_name="seq", layout=layout, return_lse=True, **options)  # noqa: E731
    return compare(sharded(fn, mesh, q, k, v, w, u, layout), want, tol, f"ring {layout}")


# ------------------------------------------------------------------ cases
@case
def fix_vma_single_device_calls_inside_shard_map():
    """Issue 22's first finding: subquad.jax.attention inside shard_map (check_vma=True), forward and backward."""
    mesh = mesh_of(4)
    q, k, v = arrays(T=64, S=64)
    slopes = jnp.asarray([0.5, 0.25])
    calls = {
        "causal+alibi": lambda a, b, c: sj.attention(
            a, b, c, is_causal=True, score_mod=lambda s, b_, h, qi, ki: s - slopes[h] * jnp.abs(qi - ki)
        ),
        "dot_product_attention": lambda a, b, c: sj.dot_product_attention(a, b, c),
    }
    # each device attends its own 16 rows to its own 16 keys
    split = lambda x: x.reshape(1, 4, 16, *x.shape[2:])  # noqa: E731

    def check(name, fn):
        body = jax.shard_map(fn, mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ)
        out, grads = jax.jit(jax.value_and_grad(lambda a, b, c: (body(a, b, c) ** 2).sum(), argnums=(0, 1, 2)))(q, k, v)
        want, want_grads = jax.jit(
            jax.value_and_grad(
                lambda a, b, c: (jax.vmap(fn, in_axes=1, out_axes=1)(split(a), split(b), split(c)) ** 2).sum(),
                argnums=(0, 1, 2),
            )
        )(q, k, v)
        assert abs(float(out - want)) < 1e-9, name
        assert all(np.abs(np.asarray(g - w)).max() < 1e-12 for g, w in zip(grads, want_grads)), name

    for name, fn in calls.items():
        check(name, fn)
    return "attention (causal + ALiBi callback), dot_product_attention: forward and grad under check_vma=True"


@case
def ring_plain_contiguous():
    return ring_vs_whole(mesh_of(4), "contiguous", *arrays())


@case
def ring_causal_zigzag():
    return ring_vs_whole(mesh_of(4), "zigzag", *arrays(), is_causal=True, chunk_size=(3, 2))


@case
def ring_causal_contiguous():
    return ring_vs_whole(mesh_of(4), "contiguous", *arrays(), is_causal=True)


@case
def ring_causal_zigzag_two_devices_gqa():
    return ring_vs_whole(mesh_of(2), "zigzag", *arrays(N=4, K=2, T=24, S=24), is_causal=True)


@case
def ring_alibi_and_sliding_window_callbacks():
    slopes = jnp.asarray([0.5, 0.125, 0.25, 1.0])

    def alibi(s, b, h, qi, ki):
        return s - slopes[h] * jnp.abs(qi - ki)

    def window(b, h, qi, ki):
        return (ki <= qi) & (qi - ki < 7)

    return ring_vs_whole(mesh_of(4), "zigzag", *arrays(N=4, K=1), score_mod=alibi, mask_mod=window)


@case
def ring_document_mask_closing_over_ids():
    docs = jnp.asarray(np.repeat([0, 1, 2, 3], [5, 14, 3, 10]))

    def same_doc(b, h, qi, ki):
        return (docs[qi] == docs[ki]) & (ki <= qi)

    return ring_vs_whole(mesh_of(4), "zigzag", *arrays(), mask_mod=same_doc)


@case
def ring_bias_and_mask_rows_sharded():
    mesh = mesh_of(4)
    q, k, v = arrays()
    bias = jnp.asarray(RNG.standard_normal((1, 2, 32, 32)))
    keep = jnp.asarray(RNG.random((1, 1, 32, 32)) > 0.3)
    w, u = weights(q, v)
    want = reference(q, k, v, w, u, bias=bias, mask=keep)
    to = lambda x: sj.shard(x, 4, layout="zigzag", axis=2)  # noqa: E731
    fn = lambda a, b, c, bi, m: sj.ring_attention(a, b, c, axis_name="seq", bias=bi, mask=m, return_lse=True)  # noqa: E731
    body = jax.shard_map(fn, mesh=mesh, in_specs=(SEQ,) * 3 + (P(None, None, "seq"),) * 2, out_specs=(SEQ, SEQ))

    def loss(q, k, v, w, u, bi, m):
        out, lse = body(q, k, v, bi, m)
        return (out * w).sum() + (lse * u).sum(), (out, lse)

    sh = lambda x: sj.shard(x, 4)  # noqa: E731
    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        sh(q), sh(k), sh(v), sh(w), sh(u), to(bias), to(keep)
    )
    un = lambda x: sj.unshard(x, 4)  # noqa: E731
    return compare((un(out), un(lse), tuple(un(g) for g in grads)), want, 1e-10, "bias+mask")


@case
def ulysses_causal_and_callbacks():
    slopes = jnp.asarray([0.5, 0.125, 0.25, 1.0])
    q, k, v = arrays(N=4, K=4)
    w, u = weights(q, v)
    score = lambda s, b, h, qi, ki: s - slopes[h] * jnp.abs(qi - ki)  # noqa: E731
    want = reference(q, k, v, w, u, is_causal=True, score_mod=score)
    fn = lambda a, b, c: sj.ulysses_attention(  # noqa: E731
        a, b, c, axis_name="seq", is_causal=True, score_mod=score, return_lse=True
    )
    return compare(sharded(fn, mesh_of(4), q, k, v, w, u, "zigzag"), want, 1e-10, "ulysses")


@case
def ulysses_gqa_two_devices_contiguous():
    q, k, v = arrays(N=4, K=2)
    w, u = weights(q, v)
    want = reference(q, k, v, w, u, is_causal=True)
    fn = lambda a, b, c: sj.ulysses_attention(  # noqa: E731
        a, b, c, axis_name="seq", is_causal=True, layout="contiguous", return_lse=True
    )
    return compare(sharded(fn, mesh_of(2), q, k, v, w, u, "contiguous"), want, 1e-10, "ulysses gqa")


@case
def ring_shards_of_length_one():
    return ring_vs_whole(mesh_of(4), "contiguous", *arrays(T=4, S=4), is_causal=True)


@case
def ring_bf16_within_tolerance():
    q, k, v = arrays(N=2, K=1, H=16)
    w, u = weights(q, v)
    want = reference(q, k, v, w, u, is_causal=True)  # float64: the golden
    lo = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    naive = reference(*lo, w.astype(jnp.bfloat16), u, is_causal=True)  # single-device bf16
    fn = lambda a, b, c: sj.ring_attention(a, b, c, axis_name="seq", is_causal=True, return_lse=True)  # noqa: E731
    got = sharded(fn, mesh_of(4), *lo, w.astype(jnp.bfloat16), u, "zigzag")
    assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
    errs = []
    for name, a, b, r in zip(
        ("out", "lse", "dq", "dk", "dv"),
        (got[0], got[1], *got[2]),
        (want[0], want[1], *want[2]),
        (naive[0], naive[1], *naive[2]),
    ):
        a, b, r = (np.asarray(x, np.float64) for x in (a, b, r))
        e, e_ref = np.abs(a - b).max(), np.abs(r - b).max()
        errs.append(f"{name} {e:.1e} (single-device bf16 {e_ref:.1e})")
        assert e <= 3 * e_ref + 8e-3 * max(1.0, np.abs(b).max()), f"bf16 {name}: {e:.3e} vs single-device {e_ref:.3e}"
    return ", ".join(errs)


@case
def vmap_over_batch_and_jit():
    mesh = mesh_of(4)
    q, k, v = arrays(B=3)
    fn = jax.shard_map(
        lambda a, b, c: sj.ring_attention(a, b, c, axis_name="seq", is_causal=True),
        mesh=mesh,
        in_specs=(P("seq"),) * 3,
        out_specs=P("seq"),  # (T, N, H) per example, sharded along T
    )
    sh = lambda x: jax.vmap(lambda e: sj.shard(e, 4, axis=0))(x)  # noqa: E731
    un = lambda x: jax.vmap(lambda e: sj.unshard(e, 4, axis=0))(x)  # noqa: E731
    per_example = jax.jit(jax.vmap(jax.value_and_grad(lambda a, b, c: (fn(a, b, c) ** 2).sum(), argnums=(0, 1, 2))))
    loss, grads = per_example(sh(q), sh(k), sh(v))
    want_loss, want_grads = jax.jit(
        jax.vmap(
            jax.value_and_grad(lambda a, b, c: (sj.attention(a, b, c, is_causal=True) ** 2).sum(), argnums=(0, 1, 2))
        )
    )(q, k, v)
    err = float(np.abs(np.asarray(loss - want_loss)).max())
    gerr = max(float(np.abs(np.asarray(un(g) - w)).max()) for g, w in zip(grads, want_grads))
    assert err < 1e-10 and gerr < 1e-10, (err, gerr)
    return f"vmap of value_and_grad: per-example loss {err:.1e}, gradients {gerr:.1e}"


@case
def mesh_wrapper_auto_and_explain():
    q, k, v = arrays(N=4, K=4)
    w, u = weights(q, v)

    def check(n, explicit, strategy):
        mesh = mesh_of(n, explicit)
        qs, ks, vs = (jax.device_put(x, NamedSharding(mesh, SEQ)) for x in (q, k, v))
        want = reference(q, k, v, w, u, is_causal=True)

        def loss(q, k, v):
            out, lse = sj.attention(q, k, v, is_causal=True, mesh=mesh, strategy=strategy, return_lse=True)
            return (out * w).sum() + (lse * u).sum(), (out, lse)

        (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(qs, ks, vs)
        compare((out, lse, grads), want, 1e-10, f"mesh P={n} {strategy}")
        return sj.explain(q, k, v, is_causal=True, mesh=mesh, strategy=strategy).splitlines()[0]

    results = [check(n, explicit, strategy) for n, explicit, strategy in ((4, True, "auto"), (2, False, "ring"))]
    auto4 = sj.explain(q, k, v, is_causal=True, mesh=mesh_of(4))
    assert "ulysses over 4 devices" in auto4 and "not ring: sends" in auto4, auto4
    gqa = sj.explain(*arrays(N=4, K=2), mesh=mesh_of(4))
    assert "ring over 4 devices" in gqa and "not divisible" in gqa, gqa
    tie = sj.explain(q, k, v, mesh=mesh_of(2))
    assert "ring over 2 devices" in tie and "not ulysses: sends" in tie, tie
    return " | ".join(results) + "\n" + auto4


@case
def memory_per_device_at_most_a_quarter_plus_kv_in_flight():
    """memory_analysis() of the compiled programs: ring at P=4 vs one device on the whole sequence.

    Bound: a quarter of the one-device program's temporaries, plus the K/V shards in flight (the
    one in hand and the one arriving; in the backward their dK/dV too), plus one block call's own
    temporaries as the memory model counts them (a chunk's scores do not shrink with P).
    """
    from subquad.jax._call import memory_model, prepare
    from subquad.jax._sharded import mesh_plan

    mesh = mesh_of(4)
    B, T, N, H = 1, 16384, 2, 16
    whole = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    local = dict(chunk_size=(64, 64))
    block = prepare(*(jnp.zeros((B, T // 4, N, H), jnp.float32),) * 3, is_causal=True, **local).spec
    plan = mesh_plan(
        whole,
        whole,
        whole,
        None,
        None,
        mesh=mesh,
        axis_name="seq",
        strategy="ring",
        layout="contiguous",
        is_causal=True,
        score_mod=None,
        mask_mod=None,
        scale=None,
        memory_budget=None,
        **local,
    )

    def temp(fn, *args):
        return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes

    one = lambda a, b, c: sj.attention(a, b, c, is_causal=True, **local)  # noqa: E731
    ring = jax.shard_map(
        lambda a, b, c: sj.ring_attention(a, b, c, axis_name="seq", is_causal=True, layout="contiguous", **local),
        mesh=mesh,
        in_specs=(SEQ,) * 3,
        out_specs=SEQ,
    )
    lines = []
    for grad in (False, True):
        if grad:
            one_f = jax.grad(lambda a, b, c: one(a, b, c).sum(), argnums=(0, 1, 2))
            ring_f = jax.grad(lambda a, b, c: ring(a, b, c).sum(), argnums=(0, 1, 2))
        else:
            one_f, ring_f = one, ring
        single, per_device = temp(one_f, whole, whole, whole), temp(ring_f, whole, whole, whole)
        kv_in_flight = 2 * B * (T // 4) * N * 2 * H * 4  # the K/V shard in hand and the one arriving
        if grad:
            kv_in_flight *= 2  # and their dK/dV accumulators
        block_bytes = memory_model(block, jnp.float32, need_grad=grad)
        bound = single / 4 + kv_in_flight + block_bytes
        lines.append(
            f"{'fwd+bwd' if grad else 'forward'}: one device {single / 2**20:.2f} MiB, ring per device "
            f"{per_device / 2**20:.2f} MiB <= {bound / 2**20:.2f} MiB (1/4: {single / 4 / 2**20:.2f}, K/V in flight "
            f"{kv_in_flight / 2**20:.2f}, one block {block_bytes / 2**20:.2f})"
        )
        assert per_device <= bound, lines[-1]
        predicted = plan.backward_bytes if grad else plan.forward_bytes
        lines[-1] += f"; explain's model {predicted / 2**20:.2f} MiB"
        assert per_device <= predicted, lines[-1]  # the per-device memory model is an upper bound
    return "; ".join(lines)


@case
def refusals_name_the_argument():
    import pytest

    mesh = mesh_of(4)
    q, k, v = arrays()
    run = lambda fn, *x: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(SEQ,) * len(x), out_specs=SEQ)).trace(*x)  # noqa: E731
    with pytest.raises(ValueError, match="axis_name='seq' is not bound"):
        sj.ring_attention(q, k, v, axis_name="seq")
    with pytest.raises(ValueError, match="Unknown layout='spiral'"):
        run(lambda a, b, c: sj.ring_attention(a, b, c, axis_name="seq", layout="spiral"), q, k, v)
    odd = arrays(T=12, S=12)
    with pytest.raises(ValueError, match="layout='zigzag' cuts the sequence into 8 equal parts"):
        run(lambda a, b, c: sj.ring_attention(a, b, c, axis_name="seq"), *odd)
    with pytest.raises(ValueError, match="query heads N=2 and key/value heads K=2 must both be multiples of 4"):
        run(lambda a, b, c: sj.ulysses_attention(a, b, c, axis_name="seq"), q, k, v)
    with pytest.raises(ValueError, match=r"Expected bias to broadcast to \(B, N, T, S\) = \(1, 2, 8, 32\)"):
        run(lambda a, b, c: sj.ring_attention(a, b, c, axis_name="seq", bias=jnp.zeros((1, 2, 8, 8))), q, k, v)
    with pytest.raises(TypeError, match="Expected bias to have a floating dtype"):
        run(
            lambda a, b, c: sj.ring_attention(a, b, c, axis_name="seq", bias=jnp.zeros((1, 1, 1, 32), jnp.int32)),
            q,
            k,
            v,
        )
    with pytest.raises(TypeError, match="Expected mask to be bool"):
        run(lambda a, b, c: sj.ring_attention(a, b, c, axis_name="seq", mask=jnp.zeros((1, 1, 1, 32))), q, k, v)
    with pytest.raises(ValueError, match="axis_name='seq' is not bound"):
        sj.ulysses_attention(q, k, v, axis_name="seq")
    with pytest.raises(ValueError, match="Unknown strategy='fast'"):
        sj.attention(q, k, v, mesh=mesh, strategy="fast")
    with pytest.raises(ValueError, match="strategy='ulysses' cannot run this call: the heads"):
        sj.attention(q, k, v, mesh=mesh, strategy="ulysses")
    with pytest.raises(ValueError, match="axis_name='data' is not an axis of the mesh"):
        sj.attention(q, k, v, mesh=mesh, axis_name="data")
    with pytest.raises(TypeError, match=r"Expected mesh to be a jax\.sharding\.Mesh"):
        sj.attention(q, k, v, mesh="seq")
    with pytest.raises(ValueError, match="axis_name, strategy and layout go with mesh="):
        sj.attention(q, k, v, strategy="ring")
    with pytest.raises(NotImplementedError, match="local_window_size is not available with mesh="):
        sj.attention(q, k, v, mesh=mesh, local_window_size=3)
    with pytest.raises(ValueError, match="query's sequence \\(30\\)"):
        sj.attention(*arrays(T=30, S=30), mesh=mesh, is_causal=True)
    with pytest.raises(ValueError, match="Unknown layout='rows'"):
        sj.shard(q, 4, layout="rows")
    with pytest.raises(ValueError, match="Unknown layout='rows'"):
        sj.attention(q, k, v, mesh=mesh, layout="rows")
    with pytest.raises(
        TypeError, match=r"explain\(mesh=...\) got unexpected keyword arguments \['local_window_size'\]"
    ):
        sj.explain(q, k, v, mesh=mesh, local_window_size=3)
    with pytest.raises(ValueError, match="mesh has axes \\('data', 'seq'\\): pass axis_name="):
        sj.attention(q, k, v, mesh=jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "seq")))
    return "19 refusals"


def main(names):
    for name in names or CASES:
        start = time.perf_counter()
        try:
            detail, ok = CASES[name](), True
        except Exception as e:  # reported, not raised: the other cases still run
            detail, ok = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}", False
        print(
            json.dumps(
                {"case": name, "ok": ok, "detail": str(detail), "seconds": round(time.perf_counter() - start, 1)}
            ),
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
