"""Calls that mypy must refuse: each wrong call carries the ignore it needs, so that
``mypy --warn-unused-ignores`` fails the day one of them type-checks (the annotations got
looser). Never run, never collected by pytest (the name does not match ``test_*.py``).

CI: ``mypy && mypy --warn-unused-ignores tests/typing/public_api_misuse.py``
"""

from __future__ import annotations

import torch

import subquad
from subquad import mods
from subquad._backends import BACKENDS, Matmul, Options
from subquad._validate import make_inputs

q = k = v = torch.zeros(1, 2, 8, 4)

# The public face: keyword types.
subquad.attention(q, k, v, memory_budget=[1])  # type: ignore[arg-type]
subquad.attention(q, k, v, chunk_size="512")  # type: ignore[arg-type]
subquad.attention(q, k, v, scale="0.5")  # type: ignore[arg-type]
subquad.sdpa(q, k, v, is_causal="yes")  # type: ignore[arg-type]
subquad.sdpa(q, k, v, attn_mask=[[True]])  # type: ignore[arg-type]
subquad.explain(q, k, v, backend=None)  # type: ignore[arg-type]
subquad.varlen_attention(q, k, v, [0, 8], [0, 8], max_seqlen_q="8")  # type: ignore[arg-type]
mods.alibi_slopes("8")  # type: ignore[arg-type]

# Keyword-only after q, k, v.
subquad.attention(q, k, v, None, True)  # type: ignore[call-arg]

# What a call returns: the output, or (out, lse); neither is a plan.
plan: subquad.Plan = subquad.attention(q, k, v)  # type: ignore[assignment]

# A backend: its budget is bytes (an int), its options one frozen object.
inp = make_inputs(q, k, v)
Matmul().fit(inp, Options(), "2GiB")  # type: ignore[arg-type]
BACKENDS["matmul"].fit(inp, {"return_lse": True}, 1 << 30)  # type: ignore[arg-type]
BACKENDS["fused"].forward_bytes(inp, 64.0, 64, False)  # type: ignore[arg-type]
