"""Run attention calls in this (fresh) process and report their RSS high-water marks as JSON.

Started by tests with ``MALLOC_MMAP_THRESHOLD_=131072`` so that freed tensors return to the OS.
"""

from __future__ import annotations

import gc
import json
import sys

import torch

import subquad


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def run(case: dict) -> dict:
    B, H, Lq, Lk, E = case["shape"]
    dt = getattr(torch, case.get("dtype", "float32"))
    g = torch.Generator().manual_seed(0)
    grad = case.get("grad", False)
    q = torch.randn(B, H, Lq, E, generator=g, dtype=dt).requires_grad_(grad)
    k = torch.randn(B, H, Lk, E, generator=g, dtype=dt).requires_grad_(grad)
    v = torch.randn(B, H, Lk, E, generator=g, dtype=dt).requires_grad_(grad)
    kw: dict = dict(memory_budget=case["budget"], backend=case.get("backend", "auto"))
    mask = case.get("mask")
    if mask == "bool":
        kw["attn_mask"] = torch.rand(Lq, Lk, generator=g) > 0.2
    elif mask == "float":
        kw["attn_mask"] = torch.randn(1, H, Lq, Lk, generator=g, dtype=dt)
    elif mask == "causal":
        kw["is_causal"] = True
    plan = subquad.explain(q, k, v, **kw)

    def call():
        out = subquad.attention(q, k, v, **kw)
        if grad:
            out.backward(torch.ones_like(out))
        return out

    call()  # warm-up: thread pools and lazy initialisation are not the call's memory
    if grad:
        for t in (q, k, v):
            t.grad = None
    gc.collect()
    base = _kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out = call()
    peak = _kib("VmHWM") - base
    out_bytes = out.numel() * out.element_size()
    if grad:  # the gradients are outputs too
        out_bytes += sum(t.numel() * t.element_size() for t in (q, k, v))
    return dict(
        case=case, backend=plan.backend, chunk=plan.chunk_size, predicted=plan.predicted_peak_bytes,
        budget=plan.budget_bytes, measured=peak, output=out_bytes,
    )


if __name__ == "__main__":
    results = [run(c) for c in json.loads(sys.argv[1])]
    print(json.dumps(results))
