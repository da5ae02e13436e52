"""``subquad bench --framework jax``: subquad.jax against XLA's attention and the seed's JAX code.

For each case (shape ``(B, T, N, H)``, mask, mode) and implementation: the median time of jitted
calls after a compile and a warm-up (``block_until_ready``), the compiled program's temporary
memory (``jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes``: everything XLA
allocates beyond the arguments and outputs), and the largest error of sampled output rows against
a float64 NumPy reference. ``train`` is forward+backward: the gradient of ``sum(out * w)`` with
respect to query, key and value.

Implementations:

* ``subquad-jax``: :func:`subquad.jax.attention` (default chunks, or ``--budget``);
* ``jax-xla``: ``jax.nn.dot_product_attention`` (``implementation=None``: XLA, the whole score matrix);
* ``mea-jax``: the seed, ``memory_efficient_attention.efficient_dot_product_attention`` (PyPI
  ``memory-efficient-attention`` 0.1.3) at its default chunks (1024 query rows, 4096 keys), causal
  through its ``mask_calc_fn``; where it is installed.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

PRESETS: Dict[str, Dict[str, Any]] = {
    # (B, T, N, H): the sizes of the JAX issue; fp32 on CPU.
    "jax": {"shapes": [(1, 4096, 8, 64), (1, 8192, 8, 64)], "masks": ["none", "causal"], "modes": ["forward", "train"]},
    "jax-quick": {"shapes": [(1, 1024, 4, 64)], "masks": ["none", "causal"], "modes": ["forward", "train"]},
}
IMPLS = ("subquad-jax", "jax-xla", "mea-jax")


def _impl(name: str, causal: bool, budget: Optional[str]) -> Optional[Callable[..., Any]]:
    import jax.numpy as jnp

    if name == "subquad-jax":
        import subquad.jax as sj  # optional: JAX (pip install subquad[jax]), imported only to run it

        return lambda q, k, v: sj.attention(q, k, v, is_causal=causal, memory_budget=budget)
    if name == "jax-xla":
        import jax

        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    if name == "mea-jax":
        try:
            from memory_efficient_attention import (
                efficient_dot_product_attention_jax as efficient_dot_product_attention,
            )
        except ImportError:
            return None
        q_chunk, k_chunk = 1024, 4096  # the seed's defaults

        def causal_mask(q_offset: Any, k_offset: Any, mask: Any, weights: Any, data: Any) -> Any:
            tq, tk = weights.shape[-3], weights.shape[-1]
            rows = q_offset + jnp.arange(tq)[:, None]
            cols = k_offset + jnp.arange(tk)[None, :]
            return (cols <= rows)[None]  # (h=1, q, k): the seed transposes '...hqk->...qhk'

        def run(q: Any, k: Any, v: Any) -> Any:
            return efficient_dot_product_attention(
                q,
                k,
                v,
                query_chunk_size=q_chunk,
                key_chunk_size=k_chunk,
                mask_calc_fn=causal_mask if causal else None,
            )

        return run
    raise ValueError(f"unknown JAX implementation {name!r}; choose from {IMPLS}")


def _reference_rows(q: Any, k: Any, v: Any, causal: bool, rows: Sequence[int]) -> Any:
    import numpy as np

    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    H = q64.shape[-1]
    s = np.einsum("btnh,bsnh->bnts", q64[:, rows], k64) / math.sqrt(H)
    if causal:
        keys = np.arange(k64.shape[1])[None, :]
        s = np.where(keys <= np.asarray(rows)[:, None], s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnd->btnd", p, v64)


def run_case(
    name: str, shape: Tuple[int, int, int, int], mask: str, mode: str, seconds: float, budget: Optional[str]
) -> Dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    _B, T, _N, _H = shape
    causal = mask == "causal"
    result: Dict[str, Any] = {"impl": name, "shape": list(shape), "mask": mask, "mode": mode, "dtype": "fp32"}
    fn = _impl(name, causal, budget)
    if fn is None:
        return {**result, "status": "unsupported", "reason": "not installed"}
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3))
    if mode == "train":
        w = jnp.asarray(rng.standard_normal(shape), jnp.float32)
        call = jax.jit(jax.grad(lambda q, k, v: (fn(q, k, v) * w).sum(), argnums=(0, 1, 2)))
    else:
        call = jax.jit(fn)
    try:
        t0 = time.perf_counter()
        compiled = call.lower(q, k, v).compile()
        result["compile_s"] = time.perf_counter() - t0
        memory = compiled.memory_analysis()
        # None raises here, recorded as the run's error.
        result["temp_bytes"] = int(memory.temp_size_in_bytes)  # type: ignore[union-attr]
        out = jax.block_until_ready(compiled(q, k, v))  # warm-up
        times: List[float] = []
        start = time.perf_counter()
        while len(times) < 3 or (time.perf_counter() - start < seconds and len(times) < 50):
            t = time.perf_counter()
            out = jax.block_until_ready(compiled(q, k, v))
            times.append(time.perf_counter() - t)
        result["time_s"] = statistics.median(times)
        result["calls"] = len(times)
        if mode == "forward":
            rows = sorted(set(np.linspace(0, T - 1, 16).astype(int).tolist()))
            want = _reference_rows(q, k, v, causal, rows)
            result["max_error"] = float(np.abs(np.asarray(out, np.float64)[:, rows] - want).max())
        result["status"] = "ok"
    except Exception as e:  # recorded as a result: one implementation failing must not end the run
        result.update(
            status="oom" if "RESOURCE_EXHAUSTED" in str(e) else "error", reason=f"{type(e).__name__}: {e}"[:300]
        )
    return result


def _fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def table(results: List[Dict[str, Any]]) -> str:
    lines = [f"{'case':34} {'impl':12} {'time':>10} {'vs xla':>7} {'temp memory':>12} {'vs xla':>7} {'max err':>8}"]
    by_case: Dict[Tuple[Any, ...], Dict[str, Dict[str, Any]]] = {}
    for r in results:
        by_case.setdefault((tuple(r["shape"]), r["mask"], r["mode"]), {})[r["impl"]] = r
    for (shape, mask, mode), impls in by_case.items():
        base = impls.get("jax-xla", {})
        for name, r in impls.items():
            case = f"{'x'.join(map(str, shape))} {mask} {mode}"
            if r.get("status") != "ok":
                lines.append(f"{case:34} {name:12} {r.get('status')}: {r.get('reason', '')}")
                continue
            t_ratio = r["time_s"] / base["time_s"] if base.get("status") == "ok" else float("nan")
            m_ratio = (
                r["temp_bytes"] / base["temp_bytes"]
                if base.get("status") == "ok" and base["temp_bytes"]
                else float("nan")
            )
            err = f"{r['max_error']:.1e}" if "max_error" in r else "-"
            lines.append(
                f"{case:34} {name:12} {r['time_s'] * 1e3:8.1f}ms {t_ratio:6.2f}x {_fmt_bytes(r['temp_bytes']):>12} {m_ratio:6.3f}x {err:>8}"
            )
    return "\n".join(lines)


def main(
    preset: str = "jax",
    impls: Sequence[str] = IMPLS,
    seconds: float = 3.0,
    budget: Optional[str] = None,
    out: Optional[str] = None,
) -> List[Dict[str, Any]]:
    try:
        import jax
    except ImportError:
        raise SystemExit("subquad bench --framework jax needs JAX: pip install 'subquad[jax]'") from None
    cfg = PRESETS[preset]
    results = []
    for shape in cfg["shapes"]:
        for mask in cfg["masks"]:
            for mode in cfg["modes"]:
                for name in impls:
                    r = run_case(name, shape, mask, mode, seconds, budget)
                    results.append(r)
                    status = (
                        f"{r['time_s'] * 1e3:.1f} ms, temp {_fmt_bytes(r['temp_bytes'])}"
                        if r.get("status") == "ok"
                        else r.get("status")
                    )
                    print(f"  {'x'.join(map(str, shape))} {mask} {mode} {name}: {status}", flush=True)
    print()
    print(table(results))
    if out:
        import os

        os.makedirs(out, exist_ok=True)
        meta = {
            "jax": jax.__version__,
            "devices": [str(d) for d in jax.devices()],
            "platform": platform.platform(),
            "processor": platform.processor(),
            "preset": preset,
            "budget": budget,
        }
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        with open(os.path.join(out, "results.txt"), "w") as f:
            f.write(table(results) + "\n")
    return results
