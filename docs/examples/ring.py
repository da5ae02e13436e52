"""Context-parallel attention across processes with subquad.distributed.

    torchrun --nproc-per-node 4 docs/examples/ring.py            # gloo on CPU (this machine)
    torchrun --nproc-per-node 8 docs/examples/ring.py --nccl     # one GPU per rank

Every rank builds the same sequence (a fixed seed), keeps its zigzag shard of it, and the ranks
compute causal attention with ALiBi and a sliding window over the whole sequence together,
forward and backward. Rank 0 then checks the gathered result against one process running
subquad.attention on the whole sequence, and prints what the planner chose.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

import subquad
from subquad import distributed as sd
from subquad import mods


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--nccl", action="store_true")
    args = ap.parse_args()
    backend = "nccl" if args.nccl else "gloo"
    # A rank that fails makes the others raise after this timeout instead of waiting forever.
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    rank, P = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if args.nccl else torch.device("cpu")
    if not args.nccl:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // P))

    g = torch.Generator().manual_seed(0)
    whole = [torch.randn(1, args.heads, args.length, 64, generator=g).to(device) for _ in range(3)]
    q, k, v = (sd.shard(t, dim=-2).requires_grad_() for t in whole)  # (1, H, L/P, 64) each

    options = dict(is_causal=True, score_mod=mods.alibi(args.heads), mask_mod=mods.sliding_window(1024, causal=True))
    plan = sd.explain(q, k, v, **options)
    out = sd.attention(q, k, v, **options)
    out.sum().backward()

    gathered = sd.unshard(out.detach(), dim=-2)
    if rank == 0:
        print(plan)
        reference = subquad.attention(*whole, **options)
        err = (gathered - reference).abs().max().item()
        print(f"{P} ranks, L={args.length}: output {tuple(gathered.shape)}, max difference from one process {err:.2e}")
        print(f"this rank's dq {tuple(q.grad.shape)}, |dq| = {q.grad.norm():.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
