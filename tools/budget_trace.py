"""Follow ``memory_budget`` through subquad: which modules the calls that receive it live in.

A *stop* is a call of one of subquad's functions with the budget among its arguments (the
caller's value, or the bytes it resolves to, or an object carrying them: a plan, a call record).
A *return* is a stop in a module the budget had already left for another one. Used by
``tests/test_architecture.py`` (the bounds of issue 19) and runnable by hand::

    python tools/budget_trace.py          # prints the path of a few representative calls
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List

BUDGET = "16MiB"
BUDGET_BYTES = 16 << 20


def _carries(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, str):
        return value == BUDGET
    if isinstance(value, int):
        return value == BUDGET_BYTES
    for name in ("budget", "budget_bytes", "memory_budget"):
        try:
            got = getattr(value, name, None)
        except Exception:  # noqa: BLE001 - objects whose attributes raise carry nothing
            continue
        if got is not None and not callable(got) and _carries(got):
            return True
    return False


def trace(fn: Callable[[], Any]) -> List[str]:
    """The modules of the stops of ``fn()``, in order (``subquad._api``, ``subquad._planner``, ...)."""
    import subquad

    root = os.path.dirname(os.path.abspath(subquad.__file__))
    stops: List[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(root):
            return
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if any(_carries(frame.f_locals.get(n)) for n in names):
            rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
            stops.append(rel[: -len(".__init__")] if rel.endswith(".__init__") else rel)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return stops


def summary(stops: List[str]) -> Dict[str, Any]:
    """Stops, returns to a module already left, and how often each module was entered."""
    entered: Dict[str, int] = {}
    seen, returns, prev = set(), 0, None
    for m in stops:
        if m != prev:
            entered[m] = entered.get(m, 0) + 1
            if m in seen:
                returns += 1
            seen.add(m)
        prev = m
    return {"stops": len(stops), "returns": returns, "entered": entered}


def representative_calls() -> Dict[str, Callable[[], Any]]:
    import torch

    import subquad

    g = torch.Generator().manual_seed(0)

    def t(*shape: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    q, k, v = t(1, 4, 512, 64), t(1, 4, 512, 64), t(1, 4, 512, 64)
    qg, kg, vg = t(1, 4, 512, 64, grad=True), t(1, 4, 512, 64, grad=True), t(1, 4, 512, 64, grad=True)
    mask = torch.rand(512, 512, generator=g) > 0.1
    return {
        "forward": lambda: subquad.attention(q, k, v, memory_budget=BUDGET),
        "forward, tiles": lambda: subquad.attention(q, k, v, memory_budget=BUDGET, chunk_size=(128, 128)),
        "causal forward+backward": lambda: subquad.attention(qg, kg, vg, is_causal=True, memory_budget=BUDGET).sum().backward(),
        "bool mask, matmul": lambda: subquad.attention(q, k, v, attn_mask=mask, memory_budget=BUDGET, backend="matmul"),
        "score_mod forward+backward": lambda: subquad.attention(
            qg, kg, vg, score_mod=lambda s, b, h, i, j: s + (i - j) * 0.01, memory_budget=BUDGET, allow_compile=False
        ).sum().backward(),
        "explain": lambda: subquad.explain(q, k, v, memory_budget=BUDGET),
    }


if __name__ == "__main__":
    for name, fn in representative_calls().items():
        fn()  # once first: caches (traced callbacks, probes) are not part of the path
        stops = trace(fn)
        s = summary(stops)
        print(f"{name}: {s['stops']} stops, {s['returns']} returns, entered {s['entered']}")
        print("   ", " -> ".join(m.replace("subquad.", "") for m in stops))
