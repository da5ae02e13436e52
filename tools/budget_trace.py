"""Follow ``memory_budget`` through subquad: the modules a call visits while the budget is on its way.

A *stop* is a call of one of subquad's functions that receives the budget, or that a function
holding the budget makes (the caller's value, the bytes it resolves to, or an object carrying
them: a plan, the autograd metadata, a call record). Reading the call's own record
(:class:`subquad._inputs.Inputs` methods and any property) is not a stop, and the backends count
as one module (``subquad._backends``: the planner asks a backend, which answers from its own
memory model). A *return* is a stop in a module the budget had already left for another one.
``tests/test_architecture.py`` bounds both; run by hand to see the path::

    python tools/budget_trace.py
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any, Callable, Dict, List, Set

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


def _record_reads() -> Set[Any]:
    """Code objects of property getters and of the call record's methods (not stops)."""
    from subquad._inputs import Inputs

    codes = {v.__code__ for v in vars(Inputs).values() if inspect.isfunction(v)}
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("subquad"):
            continue
        for obj in list(vars(module).values()):
            if inspect.isclass(obj):
                # getters written in Python only (classes re-exported from compiled libraries have others)
                codes |= {v.fget.__code__ for v in vars(obj).values()
                          if isinstance(v, property) and hasattr(v.fget, "__code__")}
    return codes


def _module(path: str, root: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
    rel = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
    return "subquad._backends" if rel.startswith("subquad._backends.") else rel


def trace(fn: Callable[[], Any]) -> List[str]:
    """The modules of the stops of ``fn()``, in order."""
    import subquad

    root = os.path.dirname(os.path.abspath(subquad.__file__))
    reads = _record_reads()
    stops: List[str] = []

    def holds(frame: Any) -> bool:
        return frame is not None and frame.f_code.co_filename.startswith(root) and any(
            _carries(v) for v in frame.f_locals.values()
        )

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(root) or frame.f_code in reads:
            return
        if holds(frame) or holds(frame.f_back):
            stops.append(_module(frame.f_code.co_filename, root))

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
    from subquad.integrations.compile import attention_op

    g = torch.Generator().manual_seed(0)

    def t(*shape: int, grad: bool = False) -> torch.Tensor:
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    q, k, v = t(1, 4, 512, 64), t(1, 4, 512, 64), t(1, 4, 512, 64)
    qg, kg, vg = t(1, 4, 512, 64, grad=True), t(1, 4, 512, 64, grad=True), t(1, 4, 512, 64, grad=True)
    mask = torch.rand(512, 512, generator=g) > 0.1
    packed = [t(4 * 128, 4, 64, grad=True) for _ in range(3)]
    cu = torch.tensor([0, 100, 228, 512], dtype=torch.int32)
    return {
        "forward": lambda: subquad.attention(q, k, v, memory_budget=BUDGET),
        "forward, tiles": lambda: subquad.attention(q, k, v, memory_budget=BUDGET, chunk_size=(128, 128)),
        "causal forward+backward": lambda: subquad.attention(qg, kg, vg, is_causal=True, memory_budget=BUDGET).sum().backward(),
        "bool mask, matmul": lambda: subquad.attention(q, k, v, attn_mask=mask, memory_budget=BUDGET, backend="matmul"),
        "score_mod forward+backward": lambda: subquad.attention(
            qg, kg, vg, score_mod=lambda s, b, h, i, j: s + (i - j) * 0.01, memory_budget=BUDGET, allow_compile=False
        ).sum().backward(),
        "explain": lambda: subquad.explain(q, k, v, memory_budget=BUDGET),
        "torch.compile operator": lambda: attention_op(q, k, v, None, True, None, False, BUDGET, None, "auto"),
        "packed sequences forward+backward": lambda: subquad.varlen_attention(
            *packed, cu, cu, is_causal=True, memory_budget=BUDGET).sum().backward(),
    }


if __name__ == "__main__":
    for name, fn in representative_calls().items():
        fn()  # once first: caches (traced callbacks, probes) are not part of the path
        stops = trace(fn)
        s = summary(stops)
        entered = {m.replace("subquad.", ""): n for m, n in s["entered"].items()}
        print(f"{name}: {s['stops']} stops, {s['returns']} returns, entered {entered}")
        print("   ", " > ".join(m.replace("subquad.", "") for m in stops))
