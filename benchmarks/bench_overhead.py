"""Per-call overhead: small and decode-step attention, subquad against torch's SDPA, and greedy
generation with a tiny Llama (``attn_implementation="subquad"`` against ``"sdpa"``).

One thread, as a decode step runs in a server worker. Calls are timed interleaved (subquad, SDPA,
subquad, ...) in rounds, so that a slow moment of the machine hits both; each figure is the
median over the rounds of the mean per-call time of a round.

    python benchmarks/bench_overhead.py [--rounds 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

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


def per_call(rounds: int, reps: int) -> dict:
    out = {}
    g = torch.Generator().manual_seed(0)
    for name, (qs, ks, gqa) in CALLS.items():
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
        print(
            f"{name:40s} subquad {row['subquad']:8.1f} us  sdpa {row['sdpa']:8.1f} us  "
            f"ratio {row['ratio']:.3f}  extra {row['extra_us']:+.1f} us",
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
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {"threads": args.threads, "torch": torch.__version__, **per_call(args.rounds, args.reps)}
    results.update(generation(args.rounds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
