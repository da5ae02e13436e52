"""subquad.jax beyond one device on CPU host devices: time and compiled memory per device.

    python benchmarks/bench_jax_ring.py                              # 8k and 16k, forward and train
    python benchmarks/bench_jax_ring.py --lengths 4096 --repeats 1   # a quick look
    python benchmarks/bench_jax_ring.py --out docs/benchmarks/data/jax/jax-ring-cpu

Four XLA host devices (``--xla_force_host_platform_device_count=4``) in one process: they share
the machine's cores, so this measures the cost of the ring (its loops, transfers and merges) and
its memory, not a speed-up. Causal, float32, ``(B, T, N, H) = (1, T, 8, 64)``.

* time: median of ``--repeats`` calls of the jitted program after a compile and a warm-up call
  (``block_until_ready``); ``train`` is forward+backward (the gradient of ``sum(out * w)`` with
  respect to q, k, v);
* memory: ``memory_analysis().temp_size_in_bytes`` of the compiled program: for the sharded
  programs that is one device's (XLA compiles one SPMD program per device);
* error: the largest difference of the output from the one-device subquad.jax output.

Implementations: ``subquad-jax`` (one device, the whole sequence), ``subquad-ring``
(:func:`subquad.jax.ring_attention`, zigzag), ``subquad-ulysses``
(:func:`subquad.jax.ulysses_attention`), and ``ringattention`` (PyPI ``ringattention`` 0.1.2,
its blockwise JAX ring, contiguous shards, 512 x 512 chunks, token-level causal) where it is
installed (``pip install ringattention==0.1.2 --no-deps`` and ``einops``; its flax import is
stubbed, flax is used only by its feed-forward helper). ringattention runs with
``check_vma=False``: its loop carries have the same shard_map typing problem subquad.jax fixed.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import types
from typing import Any, Callable, Dict, List, Optional

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import subquad.jax as sj

B, N, H = 1, 8, 64
SEQ = P(None, "seq")


def load_ringattention() -> Optional[Any]:
    """ringattention 0.1.2's JAX module, without flax (imported only for its feed-forward helper)."""
    spec = importlib.util.find_spec("ringattention")
    if spec is None or not spec.submodule_search_locations:
        return None
    if "flax" not in sys.modules:
        flax, linen = types.ModuleType("flax"), types.ModuleType("flax.linen")
        linen.partitioning = types.ModuleType("flax.linen.partitioning")
        flax.linen = linen
        sys.modules.update({"flax": flax, "flax.linen": linen, "flax.linen.partitioning": linen.partitioning})
    path = os.path.join(list(spec.submodule_search_locations)[0], "ringattention_jax.py")
    module_spec = importlib.util.spec_from_file_location("ringattention_jax_only", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)  # type: ignore[union-attr]
    except Exception as e:  # an incompatible JAX: recorded, not fatal
        print(f"ringattention not usable here: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    return module


def implementations(mesh: Mesh, ra: Optional[Any]) -> Dict[str, Callable[..., Any]]:
    one = lambda q, k, v: sj.attention(q, k, v, is_causal=True)  # noqa: E731
    ring = jax.shard_map(
        lambda q, k, v: sj.ring_attention(q, k, v, axis_name="seq", is_causal=True),
        mesh=mesh,
        in_specs=(SEQ,) * 3,
        out_specs=SEQ,
    )
    uly = jax.shard_map(
        lambda q, k, v: sj.ulysses_attention(q, k, v, axis_name="seq", is_causal=True),
        mesh=mesh,
        in_specs=(SEQ,) * 3,
        out_specs=SEQ,
    )
    found = {"subquad-jax": one, "subquad-ring": ring, "subquad-ulysses": uly}
    if ra is not None:
        kwargs = dict(
            causal_block_size=1,
            deterministic=True,
            dropout_rng=None,
            attn_pdrop=0.0,
            query_chunk_size=512,
            key_chunk_size=512,
            dtype=jnp.float32,
            policy=jax.checkpoint_policies.nothing_saveable,
            precision=None,
            prevent_cse=True,
        )

        def theirs(q: Any, k: Any, v: Any) -> Any:
            return ra.ring_attention(q, k, v, None, None, None, "seq", True, kwargs)

        found["ringattention"] = jax.shard_map(theirs, mesh=mesh, in_specs=(SEQ,) * 3, out_specs=SEQ, check_vma=False)
    return found


def layout_of(name: str) -> str:
    return {"subquad-jax": "-", "ringattention": "contiguous"}.get(name, "zigzag")


def measure(
    name: str, fn: Callable[..., Any], T: int, mode: str, repeats: int, mesh: Mesh, want: Optional[Any]
) -> Dict[str, Any]:
    rng = np.random.default_rng(0)
    q, k, v, w = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32) for _ in range(4))
    lay = layout_of(name)
    if name != "subquad-jax":
        q, k, v, w = (jax.device_put(sj.shard(x, 4, layout=lay), NamedSharding(mesh, SEQ)) for x in (q, k, v, w))
    if mode == "forward":
        program = jax.jit(fn)
    else:
        program = jax.jit(jax.grad(lambda q, k, v, w: (fn(q, k, v) * w).sum(), argnums=(0, 1, 2)))
    args = (q, k, v) if mode == "forward" else (q, k, v, w)
    start = time.perf_counter()
    compiled = program.lower(*args).compile()
    compile_s = time.perf_counter() - start
    temp = compiled.memory_analysis().temp_size_in_bytes
    result = jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    row: Dict[str, Any] = {
        "impl": name,
        "T": T,
        "mode": mode,
        "median_s": statistics.median(times),
        "times_s": times,
        "temp_bytes": int(temp),
        "compile_s": compile_s,
        "devices": 1 if name == "subquad-jax" else 4,
        "layout": lay,
    }
    if mode == "forward":
        out = result if name == "subquad-jax" else sj.unshard(result, 4, layout=lay)
        row["max_err_vs_one_device"] = None if want is None else float(jnp.abs(out - want).max())
        row["_out"] = out
    return row


def table(rows: List[Dict[str, Any]]) -> str:
    lines = [
        "| T | mode | implementation | devices | time (median) | vs one device | temp memory per device | vs one device | max error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(r["T"], r["mode"]): r for r in rows if r["impl"] == "subquad-jax"}
    for r in rows:
        b = base.get((r["T"], r["mode"]))
        err = r.get("max_err_vs_one_device")
        lines.append(
            f"| {r['T']} | {r['mode']} | {r['impl']} | {r['devices']} | {r['median_s'] * 1e3:.0f} ms | "
            f"{r['median_s'] / b['median_s']:.2f}x | {r['temp_bytes'] / 2**20:.1f} MiB | {r['temp_bytes'] / b['temp_bytes']:.2f}x | "
            f"{'-' if err is None else f'{err:.1e}'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--modes", nargs="+", default=["forward", "train"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--impls", nargs="+", default=None)
    parser.add_argument("--out", default=None, help="a folder for results.json and results.md")
    a = parser.parse_args()
    mesh = Mesh(np.array(jax.devices()[:4]), ("seq",), axis_types=(AxisType.Auto,))
    impls = implementations(mesh, load_ringattention())
    if a.impls:
        impls = {n: f for n, f in impls.items() if n in a.impls}
    rows = []
    for T in a.lengths:
        for mode in a.modes:
            want = None
            for name, fn in impls.items():
                row = measure(name, fn, T, mode, a.repeats, mesh, want)
                if name == "subquad-jax" and mode == "forward":
                    want = row["_out"]
                row.pop("_out", None)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "times_s"}), flush=True)
    print(table(rows))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        meta = {
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "jax": jax.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
            "shape": f"(1, T, {N}, {H}) float32 causal",
            "host_devices": 4,
            "note": "4 XLA host devices share the machine's 2 cores, which another engineer's benchmarks also used",
        }
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(os.path.join(a.out, "results.md"), "w") as f:
            f.write(table(rows) + "\n")


if __name__ == "__main__":
    main()
