"""Train a tiny transformer block on CPU with subquad's attention, and print the peak memory.

    MALLOC_MMAP_THRESHOLD_=131072 python docs/examples/train_block.py

The task: next-token prediction on sequences from a fixed random Markov chain (a causal language
model in miniature). The loss falls from ln(vocab) towards the chain's entropy within a few dozen
steps; attention runs in tiles within the given memory budget, forward and backward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import subquad


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, budget: str) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.budget = heads, kv_heads, dim // heads, budget
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(B, L, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(B, L, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        a = subquad.attention(q, k, v, is_causal=True, enable_gqa=True, memory_budget=self.budget)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, -1))
        return x + self.mlp(self.norm2(x))


def rss_hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(steps: int = 60, vocab: int = 16, dim: int = 64, length: int = 1024) -> None:
    torch.manual_seed(0)
    pos = nn.Embedding(length, dim)
    emb, block, head = nn.Embedding(vocab, dim), Block(dim, heads=4, kv_heads=2, budget="16MiB"), nn.Linear(dim, vocab)
    params = [*pos.parameters(), *emb.parameters(), *block.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    q = torch.empty(2, 4, length, dim // 4, requires_grad=True)
    print(subquad.explain(q, q[:, :2], q[:, :2], is_causal=True, enable_gqa=True, memory_budget="16MiB"))
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    first = None
    # A sparse random transition matrix: each token has a few likely successors.
    transition = torch.softmax(torch.randn(vocab, vocab) * 3, dim=-1)
    for step in range(steps):
        tokens = torch.empty(2, length + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (2,))
        for i in range(length):
            tokens[:, i + 1] = torch.multinomial(transition[tokens[:, i]], 1).squeeze(1)
        x, y = tokens[:, :-1], tokens[:, 1:]
        logits = head(block(emb(x) + pos.weight))
        loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        if step % 10 == 0 or step == steps - 1:
            print(f"step {step:3d}  loss {loss.item():.3f}")
    print(f"loss {first:.3f} -> {loss.item():.3f}; process peak RSS {rss_hwm_mib():.0f} MiB "
          f"(2 x {length} tokens; a materialized 4-head score matrix alone would be "
          f"{2 * 4 * length * length * 4 / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
