"""Per-call overhead: small and decode-step attention, subquad against torch's SDPA, and greedy
generation with a tiny Llama (``attn_implementation="subquad"`` against ``"sdpa"``).

One thread, as a decode step runs in a server worker. Calls are timed interleaved (subquad, SDPA,
subquad, ...) in rounds, so that a slow moment of the machine hits both; each figure is the
median over the rounds of the mean per-call time of a round.

    python benchmarks/bench_overhead.py [--rounds 7] [--only tiny] [--no-generation] [--json out.json]

Two versions of subquad in one interleaved run (``--before-src``: the ``src`` folder of the old
version, e.g. ``git archive HEAD src | tar -x -C /tmp/before``): each round starts one fresh
process per version, their order alternating from round to round, each timing subquad and SDPA
interleaved as above; the report gives each version's median time per call (subquad's and SDPA's
in the same processes) and the per-round ratios after/before::

    python benchmarks/bench_overhead.py --before-src /tmp/before/src --rounds 7 --only tiny --only "decode step"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

import subquad

CALLS = {
    # name: (query shape, key/value shape, enable_gqa)
    "decode step, GQA 32q/8kv, 512 keys": ((1, 32, 1, 128), (1, 8, 512, 128), True),
    "tiny 1x8x16x64": ((1, 8, 16, 64), (1, 8, 16, 64), False),
    "decode step, batch 8, 512 keys": ((8, 32, 1, 128), (8, 8, 512, 128), True),
    "decode step, 4096 keys": ((1, 32, 1, 128), (1, 8, 4096, 128), True),
    "cross-attention, 77 keys": ((2, 8, 1024, 64), (2, 8, 77, 64), False),
}


def per_call(rounds: int, reps: int, only: Optional[Sequence[str]] = None, verbose: bool = True) -> dict:
    out = {}
    g = torch.Generator().manual_seed(0)
    for name, (qs, ks, gqa) in CALLS.items():
        if only and not any(text in name for text in only):
            continue
        q = torch.randn(*qs, generator=g)
        k, v = torch.randn(*ks, generator=g), torch.randn(*ks, generator=g)
        impls = {
            "subquad": lambda: subquad.sdpa(q, k, v, enable_gqa=gqa),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa),
        }
        times: dict = {n: [] for n in impls}
        with torch.no_grad():
            assert (impls["subquad"]() - impls["sdpa"]()).abs().max().item() < 1e-4
            for r in range(rounds):
                for n, f in sorted(impls.items(), reverse=bool(r % 2)):  # alternate who goes first
                    for _ in range(max(3, reps // 10)):
                        f()
                    t = time.perf_counter()
                    for _ in range(reps):
                        f()
                    times[n].append((time.perf_counter() - t) / reps * 1e6)
        row = {n: statistics.median(ts) for n, ts in times.items()}
        row["ratio"] = row["subquad"] / row["sdpa"]
        row["extra_us"] = row["subquad"] - row["sdpa"]
        out[name] = row
        if verbose:
            print(
                f"{name:40s} subquad {row['subquad']:8.1f} us  sdpa {row['sdpa']:8.1f} us  "
                f"ratio {row['ratio']:.3f}  extra {row['extra_us']:+.1f} us",
                flush=True,
            )
    return out


def _version(src: str, rounds: int, reps: int, threads: int, only: Sequence[str]) -> Dict[str, dict]:
    """One fresh process importing subquad from ``src``: its :func:`per_call` rows."""
    env = {**os.environ, "PYTHONPATH": src}
    cmd = [sys.executable, __file__, "--child", "--rounds", str(rounds), "--reps", str(reps), "--threads", str(threads)]
    for text in only:
        cmd += ["--only", text]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"the process for {src} failed:\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["subquad"].startswith(os.path.abspath(src)), f"it imported {report['subquad']}, not {src}"
    return report["calls"]


def before_after(
    before: str, after: str, rounds: int, child_rounds: int, reps: int, threads: int, only: Sequence[str]
) -> dict:
    """Both versions in alternating fresh processes: median us per call and per-round ratios after/before."""
    runs: Dict[str, List[Dict[str, dict]]] = {"before": [], "after": []}
    for r in range(rounds):
        for v in ("before", "after") if r % 2 == 0 else ("after", "before"):
            runs[v].append(_version(before if v == "before" else after, child_rounds, reps, threads, only))
            print(f"round {r + 1}/{rounds} {v} done", file=sys.stderr, flush=True)
    out: dict = {}
    for name in runs["after"][0]:
        b = [x[name] for x in runs["before"]]
        a = [x[name] for x in runs["after"]]
        time_ratios = [x["subquad"] / y["subquad"] for x, y in zip(a, b)]
        sdpa_ratios = [x["ratio"] / y["ratio"] for x, y in zip(a, b)]  # (subquad/SDPA) after over before
        row = {
            "before_us": statistics.median(x["subquad"] for x in b),
            "after_us": statistics.median(x["subquad"] for x in a),
            "sdpa_us_before_runs": statistics.median(x["sdpa"] for x in b),
            "sdpa_us_after_runs": statistics.median(x["sdpa"] for x in a),
            "after_over_before": statistics.median(time_ratios),
            "after_over_before_per_round": time_ratios,
            "vs_sdpa_after_over_before": statistics.median(sdpa_ratios),
            "vs_sdpa_after_over_before_per_round": sdpa_ratios,
        }
        out[name] = row
        rounds_text = " ".join(f"{x:.3f}" for x in time_ratios)
        print(
            f"{name:40s} before {row['before_us']:8.1f} us  after {row['after_us']:8.1f} us  "
            f"SDPA {row['sdpa_us_before_runs']:7.1f}/{row['sdpa_us_after_runs']:7.1f} us  "
            f"after/before {row['after_over_before']:.3f} (rounds {rounds_text}; vs SDPA "
            f"{row['vs_sdpa_after_over_before']:.3f})",
            flush=True,
        )
    return out


def generation(rounds: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    import subquad.integrations.transformers as sqt

    sqt.register()
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 1000, (1, 256), generator=torch.Generator().manual_seed(1))
    outputs, rates = {}, {"subquad": [], "sdpa": []}
    with torch.no_grad():
        for r in range(rounds + 1):
            for impl in ("subquad", "sdpa") if r % 2 else ("sdpa", "subquad"):  # alternate who goes first
                model.set_attn_implementation(impl)
                t = time.perf_counter()
                seq = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False, min_new_tokens=64
                )
                dt = time.perf_counter() - t
                outputs[impl] = seq
                if r:  # the first round warms up
                    rates[impl].append(64 / dt)
    assert torch.equal(outputs["subquad"], outputs["sdpa"]), "greedy outputs differ"
    row = {n: statistics.median(v) for n, v in rates.items()}
    row["ratio"] = row["subquad"] / row["sdpa"]
    print(
        f"{'greedy generation, tiny GQA Llama':40s} subquad {row['subquad']:8.1f} tok/s  "
        f"sdpa {row['sdpa']:8.1f} tok/s  ratio {row['ratio']:.3f}  (outputs identical)",
        flush=True,
    )
    return {"greedy generation (tokens/s)": row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=200, help="calls per round and implementation")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", action="append", default=[], help="only the calls whose name contains this")
    parser.add_argument("--no-generation", action="store_true", help="skip greedy generation (needs transformers)")
    parser.add_argument("--before-src", help="the src folder of the version to compare this one with")
    parser.add_argument("--after-src", default=os.path.join(os.path.dirname(os.path.dirname(__file__)), "src"))
    parser.add_argument("--child-rounds", type=int, default=3, help="with --before-src: rounds in each process")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        calls = per_call(args.rounds, args.reps, args.only, verbose=False)
        print(json.dumps({"subquad": subquad.__file__, "calls": calls}))
        return
    results = {"threads": args.threads, "torch": torch.__version__}
    if args.before_src:
        results["how"] = (
            f"{args.rounds} rounds; each one fresh process per version (order alternating), each timing subquad "
            f"and SDPA interleaved for {args.child_rounds} rounds of {args.reps} calls on {args.threads} thread(s)"
        )
        results.update(
            before_after(
                args.before_src, args.after_src, args.rounds, args.child_rounds, args.reps, args.threads, args.only
            )
        )
    else:
        results.update(per_call(args.rounds, args.reps, args.only))
        if not args.no_generation:
            results.update(generation(args.rounds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
