"""Run attention calls in this (fresh) process and report their RSS high-water marks as JSON.

Started by tests with ``MALLOC_MMAP_THRESHOLD_=131072`` so that freed tensors return to the OS.

A case is a dict: ``shape`` ``[B, H, Lq, Lk, E]`` (or ``batch`` for several leading batch dims,
e.g. ``[2, 4]``), ``budget``, and optionally ``dtype``, ``backend``, ``grad``, ``chunk``, and
``mask``: ``"bool"``, ``"float"``, ``"causal"`` or ``"bool-batch"`` (a bool mask that varies
along the first batch dim only, broadcast over the others), ``score_mod``: ``"module-method"``
(a bound method of a module that also holds a large unused layer; its table is learnable),
``callbacks``: ``"user-alibi-causal"`` or ``"user-softcap-causal"`` (user-written lambdas, as
FlexAttention users write them), ``allow_compile`` (the compiled path; off unless given),
``kv_heads`` (fewer key/value heads: grouped-query attention), ``threads`` (torch's thread
count for this case; the fused kernels' working set grows with it) and ``packed``: ``[n, L]``
sequences of ``L`` tokens packed (``subquad.varlen_attention``, shape ``[1, H, L, L, E]``).
"""

from __future__ import annotations

import gc
import json
import sys

import torch

import _machine
import subquad

_machine.install()  # the suite's switches (SUBQUAD_TEST_RATE_FACTOR, ...) hold in this process too


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


class RelativeBias(torch.nn.Module):
    """A learnable relative-position bias beside a large layer the score_mod never uses."""

    def __init__(self, heads: int, length: int) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(heads, 2 * length - 1))
        self.unused = torch.nn.Linear(4096, 4096)  # 64 MiB of parameters
        self.length = length

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return score + self.table[h, q_idx - kv_idx + self.length - 1]


def run(case: dict) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(case.get("threads", threads))
    try:
        return _run(case)
    finally:
        torch.set_num_threads(threads)


def _run(case: dict) -> dict:
    B, H, Lq, Lk, E = case["shape"]
    Hk = case.get("kv_heads", H)
    batch = case.get("batch", [B])
    dt = getattr(torch, case.get("dtype", "float32"))
    g = torch.Generator().manual_seed(0)
    grad = case.get("grad", False)
    kw: dict = dict(memory_budget=case["budget"], backend=case.get("backend", "auto"), enable_gqa=Hk != H)
    if case.get("packed"):
        n, L = case["packed"]
        q = torch.randn(n * L, H, E, generator=g, dtype=dt).requires_grad_(grad)
        k = torch.randn(n * L, Hk, E, generator=g, dtype=dt).requires_grad_(grad)
        v = torch.randn(n * L, Hk, E, generator=g, dtype=dt).requires_grad_(grad)
        cu = torch.arange(0, n * L + 1, L, dtype=torch.int32)
        return _measure(
            case,
            lambda: subquad.varlen_attention(q, k, v, cu, cu, is_causal=case.get("mask") == "causal", **kw),
            lambda: subquad.varlen_explain(q, k, v, cu, cu, **kw),
            (q, k, v),
            [],
            grad,
        )
    q = torch.randn(*batch, H, Lq, E, generator=g, dtype=dt).requires_grad_(grad)
    k = torch.randn(*batch, Hk, Lk, E, generator=g, dtype=dt).requires_grad_(grad)
    v = torch.randn(*batch, Hk, Lk, E, generator=g, dtype=dt).requires_grad_(grad)
    if case.get("chunk"):
        kw["chunk_size"] = tuple(case["chunk"])
    mask = case.get("mask")
    if mask == "bool":
        kw["attn_mask"] = torch.rand(Lq, Lk, generator=g) > 0.2
    elif mask == "bool-batch":
        kw["attn_mask"] = torch.rand(batch[0], *([1] * len(batch[1:])), 1, Lq, Lk, generator=g) > 0.2
    elif mask == "float":
        kw["attn_mask"] = torch.randn(1, H, Lq, Lk, generator=g, dtype=dt)
    elif mask == "causal":
        kw["is_causal"] = True
    kw["allow_compile"] = case.get("allow_compile", False)
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / H) for i in range(H)])
    if case.get("callbacks") == "user-alibi-causal":
        kw["score_mod"] = lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki)
        kw["mask_mod"] = lambda b, h, qi, ki: ki <= qi
    elif case.get("callbacks") == "user-softcap-causal":
        kw["score_mod"] = lambda s, b, h, qi, ki: 30 * torch.tanh(s / 30)
        kw["mask_mod"] = lambda b, h, qi, ki: ki <= qi
    module = None
    if case.get("score_mod") == "module-method":
        module = RelativeBias(H, max(Lq, Lk))
        kw["score_mod"] = module.score_mod
    params = [] if module is None else list(module.parameters())
    return _measure(
        case, lambda: subquad.attention(q, k, v, **kw), lambda: subquad.explain(q, k, v, **kw), (q, k, v), params, grad
    )


def _measure(case: dict, attend, explain, inputs, params, grad: bool) -> dict:
    plan = explain()
    grad_out = None

    def call():
        nonlocal grad_out
        out = attend()
        if grad:
            grad_out = torch.ones_like(out)
            out.backward(grad_out)
        return out

    call()  # warm-up: thread pools and lazy initialisation are not the call's memory
    for t in (*inputs, *params):
        t.grad = None
    grad_out = None  # (freed during the measured call, it would hide as much of its peak)
    gc.collect()
    base = _kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out = call()
    peak = _kib("VmHWM") - base
    out_bytes = out.numel() * out.element_size()
    if grad:  # the incoming gradient is an input of the backward, the gradients are outputs
        out_bytes += grad_out.numel() * grad_out.element_size()
        out_bytes += sum(t.grad.numel() * t.grad.element_size() for t in (*inputs, *params) if t.grad is not None)
    return dict(
        case=case,
        backend=plan.backend,
        chunk=plan.chunk_size,
        predicted=plan.predicted_peak_bytes,
        budget=plan.budget_bytes,
        measured=peak,
        output=out_bytes,
        grads_set=[p.grad is not None for p in params],
    )


if __name__ == "__main__":
    results = [run(c) for c in json.loads(sys.argv[1])]
    print(json.dumps(results))
