"""The ``loops`` backend: the native kernel's C++ loops (:mod:`~subquad._backends.segments`).

``matmul``'s tiles with each row block's whole loop over keys in one C++ call, on a CPU where
``subquad build`` built the kernel: no tile of scores is ever held, the products run on the loops'
own micro-kernels or on ATen's (:mod:`~subquad._backends.calibration`), and the built-in callbacks
(soft cap, ALiBi, causal bands and windows, documents, prefix-LM, key padding; hand-written ones
traced equal to them) are evaluated inside the loops.

``matmul`` runs these loops too wherever they take a call (a user who forces the tiles gets their
fastest form); ``loops`` is the same path as a backend of its own, for the planner and
``explain()``: it refuses, in sentences, what the loops do not take
(:func:`~subquad._backends.loop_choice.refusal`), and ``auto`` asks it before the fused kernel or
after it as this CPU's calibration measured (:func:`~subquad._backends.dispatch.call_priority`).
Its memory model is the loops' own (:func:`~subquad._backends.segments.tile_bytes`,
:func:`~subquad._backends.segments.segment_bytes`, :func:`~subquad._backends.segments.backward_bytes`),
which ``matmul`` applies where they run.
"""

from __future__ import annotations

from typing import List

from .._inputs import Inputs
from . import loop_choice, segments
from .base import Options
from .matmul import Matmul


class Loops(Matmul):
    """The tiles' whole loops in C++ (CPU, the native kernel built). A call whose backward the loops
    do not take has it on ``matmul``'s tiles (with ``auto``, a packed call's on the fused kernel
    where it takes it)."""

    name = "loops"
    devices = ("cpu",)

    def not_supported_reasons(self, inp: Inputs, opts: Options) -> List[str]:
        reasons = super().not_supported_reasons(inp, opts)
        if reasons:
            return reasons
        refused = loop_choice.refusal(inp, False)  # a backward they do not take runs on matmul's tiles
        return [] if refused is None else [refused]

    def backward_backend(self, inp: Inputs, opts: Options) -> str:
        if opts.packed:  # per sequence: the backward loop where it takes one, else matmul's tiles
            return self.name
        return self.name if segments.backward_kernel(inp) is not None else "matmul"
