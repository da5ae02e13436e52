"""Context-parallel attention over torch.distributed (gloo, CPU): time, per-rank memory, bytes sent.

    python benchmarks/bench_ring.py                     # 1, 2, 4 ranks; 16k and 32k; causal fp32
    python benchmarks/bench_ring.py --lengths 4096 --ranks 1 2 --repeats 1   # a quick look

For every (implementation, ranks, length, mode) the ranks are spawned afresh (gloo on localhost,
threads per rank = cores // ranks, at least 1). Causal, float32, ``(B, H, L, E) = (1, 8, L, 64)``.

* time: the slowest rank, between barriers, median of ``--repeats`` calls after a warm-up on a
  short sequence; default allocator;
* per-rank peak: in a second spawn started with ``MALLOC_MMAP_THRESHOLD_=131072`` (freed tensors
  go back to the OS), the RSS high-water mark of one call beyond the RSS before it
  (``/proc/self/clear_refs``), the largest over the ranks; it includes the call's output (and the
  gradients, for ``train``) but not the input shards;
* bytes sent: per rank (the largest), counted on ``torch.distributed``'s send calls;
* error: the largest difference of the rank's output rows from the one-process output.

Implementations: ``one-process`` (``subquad.attention``, 1 rank), ``subquad-ring``
(:func:`subquad.distributed.ring_attention`, zigzag), ``subquad-ulysses`` (all-to-all), and
``ring-attention-pytorch`` (lucidrains, PyPI, ``ring_flash_attn`` with ``ring_reduce_col=True``,
contiguous shards, bucket 1024) where it is installed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
B, H, E = 1, 8, 64

sys.path.insert(0, HERE)
from _harness import _status_kib, machine  # noqa: E402


def _count_sends(counter: Dict[str, int]) -> None:
    """Count the bytes this rank sends, whatever the implementation calls."""
    import torch.distributed as dist

    def nbytes(t: Any) -> int:
        return t.numel() * t.element_size()

    batch = dist.batch_isend_irecv

    def batch_isend_irecv(ops: List[Any]) -> Any:
        counter["bytes"] += sum(nbytes(op.tensor) for op in ops if op.op in (dist.isend, dist.send))
        return batch(ops)

    a2a = dist.all_to_all

    def all_to_all(outs: List[Any], ins: List[Any], group: Any = None, **kw: Any) -> Any:
        me = dist.get_rank(group)
        counter["bytes"] += sum(nbytes(t) for r, t in enumerate(ins) if r != me)
        return a2a(outs, ins, group=group, **kw)

    dist.batch_isend_irecv = batch_isend_irecv
    dist.all_to_all = all_to_all


def _shard_rows(x: Any, P: int, rank: int, layout: str, dim: int) -> Any:
    import torch

    if layout == "zigzag":
        c = x.chunk(2 * P, dim)
        return torch.cat([c[rank], c[2 * P - 1 - rank]], dim)
    return x.tensor_split(P, dim)[rank]


def _worker(rank: int, P: int, port: int, cfg: Dict[str, Any], out_path: str) -> None:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // P))
    counter = {"bytes": 0}
    dist = None
    if P > 1:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=P, timeout=datetime.timedelta(minutes=30))
        _count_sends(counter)
    impl, L, mode = cfg["impl"], cfg["length"], cfg["mode"]
    layout = "contiguous" if impl == "ring-attention-pytorch" else "zigzag"
    train = mode == "train"

    def inputs(length: int) -> List[Any]:
        g = torch.Generator().manual_seed(0)
        whole = [torch.randn(B, H, length, E, generator=g) for _ in range(3)]
        return [_shard_rows(t, P, rank, layout, 2).clone().requires_grad_(train) for t in whole]

    fn = _make(impl, P)

    def call(q: Any, k: Any, v: Any) -> Any:
        out = fn(q, k, v)
        if train:
            out.backward(torch.ones_like(out))
        return out

    def barrier() -> None:
        if dist is not None:
            dist.barrier()

    call(*inputs(min(L, 256 * P)))  # warm-up: kernels, plans, connections
    qkv = inputs(L)
    result: Dict[str, Any] = {}
    if cfg["memory"]:
        import gc

        gc.collect()
        barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kib("VmRSS") * 1024
        out = call(*qkv)
        result["peak"] = _status_kib("VmHWM") * 1024 - before
        result["shard_bytes"] = sum(t.numel() * t.element_size() for t in qkv)
    else:
        times = []
        counter["bytes"] = 0
        for i in range(cfg["repeats"]):
            for t in qkv:
                t.grad = None
            barrier()
            t0 = time.perf_counter()
            out = call(*qkv)
            barrier()
            times.append(time.perf_counter() - t0)
            if i == 0:
                result["bytes_sent"] = counter["bytes"]
        result["seconds"] = statistics.median(times)
        ref_path = cfg.get("reference")
        if ref_path and os.path.exists(ref_path):
            ref = torch.load(ref_path)
            mine = out.detach() if impl != "ring-attention-pytorch" else out.detach().transpose(1, 2)
            result["error"] = float((mine - _shard_rows(ref, P, rank, layout, 2)).abs().max())
        elif ref_path and impl == "one-process" and mode == "forward":
            torch.save(out.detach(), ref_path)
    with open(out_path, "w") as f:
        json.dump(result, f)
    if dist is not None:
        dist.barrier()
        dist.destroy_process_group()


def _make(impl: str, P: int) -> Any:
    import subquad

    if impl == "one-process":
        return lambda q, k, v: subquad.attention(q, k, v, is_causal=True)
    if impl == "subquad-ring":
        from subquad import distributed as sd

        return lambda q, k, v: sd.ring_attention(q, k, v, is_causal=True)
    if impl == "subquad-ulysses":
        from subquad import distributed as sd

        return lambda q, k, v: sd.ulysses_attention(q, k, v, is_causal=True)
    if impl == "ring-attention-pytorch":
        from ring_attention_pytorch import ring_flash_attn

        def peer(q: Any, k: Any, v: Any) -> Any:
            # Its layout is (B, L, H, E); with one rank it runs its single-process flash attention.
            t = [x.transpose(1, 2) for x in (q, k, v)]
            return ring_flash_attn(*t, causal=True, bucket_size=1024, ring_reduce_col=P > 1)

        return peer
    raise ValueError(impl)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(P: int, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """Spawn the ranks with the environment for this pass; the per-rank results, merged."""
    import torch.multiprocessing as mp

    env_before = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if cfg["memory"]:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    try:
        with tempfile.TemporaryDirectory() as d:
            try:
                mp.start_processes(
                    _worker_entry, args=(P, _free_port(), cfg, d), nprocs=P, join=True, start_method="spawn"
                )
            except Exception as e:
                return {"failed": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"}
            ranks = []
            for r in range(P):
                with open(os.path.join(d, f"rank{r}.json")) as f:
                    ranks.append(json.load(f))
    finally:
        if env_before is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = env_before
    merged: Dict[str, Any] = {}
    for key in ("peak", "shard_bytes", "seconds", "bytes_sent", "error"):
        values = [r[key] for r in ranks if key in r]
        if values:
            merged[key] = max(values)
    return merged


def _worker_entry(rank: int, P: int, port: int, cfg: Dict[str, Any], d: str) -> None:
    _worker(rank, P, port, cfg, os.path.join(d, f"rank{rank}.json"))


def _peer_available() -> bool:
    try:
        import ring_attention_pytorch  # noqa: F401
    except Exception:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--modes", nargs="+", default=["forward", "train"], choices=["forward", "train"])
    ap.add_argument(
        "--impls", nargs="+", default=["one-process", "subquad-ring", "subquad-ulysses", "ring-attention-pytorch"]
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    impls = [i for i in args.impls if i != "ring-attention-pytorch" or _peer_available()]
    rows: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as refs:
        for L in args.lengths:
            for mode in args.modes:
                ref = os.path.join(refs, f"ref{L}.pt")
                for impl in impls:
                    for P in args.ranks:
                        if (impl == "one-process") != (P == 1) and impl != "ring-attention-pytorch":
                            continue
                        cfg = dict(impl=impl, length=L, mode=mode, repeats=args.repeats, reference=ref, memory=False)
                        row = dict(impl=impl, ranks=P, length=L, mode=mode)
                        row.update(_run(P, cfg))
                        if "failed" not in row:
                            mem = _run(P, dict(cfg, memory=True))
                            row.update({k: v for k, v in mem.items() if k in ("peak", "shard_bytes", "failed")})
                        rows.append(row)
                        print(_line(row), flush=True)
    _table(rows)
    if args.out:
        meta = dict(machine=machine(), shape=dict(B=B, H=H, E=E), dtype="float32", causal=True, repeats=args.repeats)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


def _mib(n: Any) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def _line(r: Dict[str, Any]) -> str:
    if "failed" in r:
        return f"{r['impl']:>22} P={r['ranks']} L={r['length']} {r['mode']:>7}: failed ({r['failed']})"
    err = f"{r['error']:.1e}" if "error" in r else "-"
    return (
        f"{r['impl']:>22} P={r['ranks']} L={r['length']} {r['mode']:>7}: {r['seconds']:.2f} s, "
        f"peak/rank {_mib(r.get('peak'))}, sent/rank {_mib(r.get('bytes_sent', 0))}, max error {err}"
    )


def _table(rows: List[Dict[str, Any]]) -> None:
    print("\n| impl | ranks | L | mode | time | vs one process | peak/rank | vs one process | sent/rank | max error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = {(r["length"], r["mode"]): r for r in rows if r["impl"] == "one-process" and "failed" not in r}
    for r in rows:
        if "failed" in r:
            print(f"| {r['impl']} | {r['ranks']} | {r['length']} | {r['mode']} | failed: {r['failed']} | | | | | |")
            continue
        b = base.get((r["length"], r["mode"]))
        t_ratio = f"{r['seconds'] / b['seconds']:.2f}x" if b else "-"
        m_ratio = f"{r['peak'] / b['peak']:.2f}x" if b and r.get("peak") and b.get("peak") else "-"
        err = f"{r['error']:.1e}" if "error" in r else "-"
        print(
            f"| {r['impl']} | {r['ranks']} | {r['length']} | {r['mode']} | {r['seconds']:.2f} s | {t_ratio} | "
            f"{_mib(r.get('peak'))} | {m_ratio} | {_mib(r.get('bytes_sent', 0))} | {err} |"
        )


if __name__ == "__main__":
    main()
