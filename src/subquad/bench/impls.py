"""The attention implementations the bench compares, as data.

Each :class:`Impl` states what it supports (devices, dtypes, masks, backward, an optional module)
and answers ``not_supported_reasons(case) -> list[str]``; a refusal found only when it runs (a
kernel that turns the input down, a forced subquad backend the planner rejects) raises
:class:`Unsupported` or is recognised by :func:`refusal_reason`. ``prepare(inputs)`` returns the
zero-argument forward call that is timed, and a dict of facts worth recording (subquad's plan);
everything an implementation must build per call (a materialized ALiBi bias, a causal mask) is
built inside that call, so it counts in its time and memory.
"""

from __future__ import annotations

import fnmatch
import importlib.util
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

import subquad
from subquad._budget import free_memory_bytes

from .cases import MASKS, SOFTCAP, WINDOW, BenchInputs, Case, alibi_bias, dense_keep

Forward = Callable[[], torch.Tensor]
Prepared = Tuple[Forward, dict]  # the timed call, and facts worth recording (a subquad plan)

# torch.OutOfMemoryError is the public name since torch 2.5; the CUDA one is the same class.
OutOfMemoryError = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError

# On a CPU, implementations that materialize B·H·Lq·Lk scores are skipped past this many score
# elements unless --no-skip: 2^28 fp32 scores took ~2 s per call on a 2-core CPU (naive, math).
CPU_MAX_SCORE_ELEMENTS = 2**28


class Unsupported(Exception):
    """An implementation refused a case; the message says why."""


@dataclass(frozen=True)
class Impl:
    name: str
    description: str
    prepare: Callable[[BenchInputs], Prepared]
    devices: tuple[str, ...] = ("cpu", "cuda", "mps")
    dtypes: tuple[str, ...] = ("fp16", "bf16", "fp32", "fp64")
    masks: tuple[str, ...] = MASKS
    backward: bool = True
    module: Optional[str] = None  # an optional dependency, found with importlib.util.find_spec
    install: Optional[str] = None
    materializes_scores: bool = False  # builds B·H·Lq·Lk: skipped on CPU past a size
    extra_reasons: Optional[Callable[[Case], list[str]]] = None
    # Exceptions that this implementation raises to refuse an input (rather than to fail).
    refusals: tuple[type, ...] = (NotImplementedError,)

    def not_supported_reasons(self, case: Case, *, skip_slow: bool = True) -> list[str]:
        """Why this implementation cannot (or should not) run ``case``; empty when it can."""
        reasons = []
        device_type = torch.device(case.device).type
        if self.module is not None and importlib.util.find_spec(self.module) is None:
            return [f"{self.module} is not installed" + (f" ({self.install})" if self.install else "")]
        if device_type not in self.devices:
            reasons.append(f"runs on {', '.join(self.devices)} only, not {device_type}")
        if case.dtype not in self.dtypes:
            reasons.append(f"supports {', '.join(self.dtypes)}, not {case.dtype}")
        if case.mask not in self.masks:
            reasons.append(f"no {case.mask} mask support in this bench's adapter")
        if case.backward and not self.backward:
            reasons.append("forward only")
        if self.extra_reasons is not None:
            reasons += self.extra_reasons(case)
        if skip_slow and self.materializes_scores and device_type == "cpu":
            reasons += _cpu_materialize_reasons(case)
        return reasons


def _cpu_materialize_reasons(case: Case) -> list[str]:
    elements = case.score_elements
    if elements > CPU_MAX_SCORE_ELEMENTS:
        return [f"skipped: too slow on CPU (B·H·Lq·Lk = {elements:,} scores > 2^28; --no-skip runs it)"]
    # Scores, their softmax and (backward) their gradients: about three score-sized buffers.
    needed = 3 * elements * case.torch_dtype.itemsize * (2 if case.backward else 1)
    available = _available_ram()
    if available is not None and needed > 0.8 * available:
        return [
            f"skipped: would materialize ≈{needed / 2**30:.1f} GiB of scores, "
            f"{available / 2**30:.1f} GiB of RAM available (--no-skip runs it)"
        ]
    return []


def _available_ram() -> Optional[int]:
    return free_memory_bytes(torch.device("cpu"))


# ------------------------------------------------------------------------------ SDPA

# A soft-cap transforms the scores: no mask expresses it.
SDPA_MASKS = tuple(m for m in MASKS if m != "softcap")


def _sdpa_mask_args(inputs: BenchInputs) -> dict:
    """SDPA's mask arguments; an ALiBi bias is materialized here, inside the timed call."""
    mask = inputs.case.mask
    if mask == "causal":
        return {"is_causal": True}
    if mask == "key-padding":
        return {"attn_mask": inputs.pad_mask}
    if mask == "alibi":
        # SDPA refuses attn_mask together with is_causal, so the causal part is in the bias.
        return {"attn_mask": alibi_bias(inputs)}
    if mask in ("window", "document"):
        return {"attn_mask": dense_keep(inputs)}
    return {}


def _sdpa(backend_name: str) -> Callable[[BenchInputs], Prepared]:
    def prepare(inputs: BenchInputs) -> Prepared:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name, None)
        if backend is None:
            raise Unsupported(f"this torch has no SDPBackend.{backend_name}")
        q, k, v, scale = inputs.query, inputs.key, inputs.value, inputs.scale

        def forward():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, scale=scale, **_sdpa_mask_args(inputs))

        return forward, {}

    return prepare


# ----------------------------------------------------------------------------- naive


def _naive(inputs: BenchInputs) -> Prepared:
    q, k, v, scale = inputs.query, inputs.key, inputs.value, inputs.scale
    case = inputs.case

    def forward():
        scores = q @ k.transpose(-2, -1) * scale
        if case.mask == "causal":
            above = torch.ones(case.q_len, case.kv_len, dtype=torch.bool, device=q.device).triu_(1)
            scores = scores.masked_fill(above, float("-inf"))
        elif case.mask == "key-padding":
            assert inputs.pad_mask is not None, "make_inputs builds pad_mask for key-padding cases"
            scores = scores.masked_fill(~inputs.pad_mask, float("-inf"))
        elif case.mask == "alibi":
            scores = scores + alibi_bias(inputs)
        elif case.mask == "softcap":
            above = torch.ones(case.q_len, case.kv_len, dtype=torch.bool, device=q.device).triu_(1)
            scores = (SOFTCAP * torch.tanh(scores / SOFTCAP)).masked_fill(above, float("-inf"))
        elif case.mask in ("window", "document"):
            scores = scores.masked_fill(~dense_keep(inputs), float("-inf"))
        return scores.softmax(dim=-1) @ v

    return forward, {}


# -------------------------------------------------------------------------- xformers


def _xformers(inputs: BenchInputs) -> Prepared:
    import xformers.ops as xops

    case = inputs.case
    # xformers wants (B, L, H, E); transposed views, as a user would pass them.
    q, k, v = (t.transpose(1, 2) for t in (inputs.query, inputs.key, inputs.value))

    def bias():
        if case.mask == "causal":
            return xops.LowerTriangularMask()
        if case.mask == "key-padding":
            assert inputs.pad_mask is not None, "make_inputs builds pad_mask for key-padding cases"
            b = torch.zeros(case.batch, 1, 1, case.kv_len, dtype=case.torch_dtype, device=q.device)
            b = b.masked_fill_(~inputs.pad_mask, float("-inf"))
            return b.expand(case.batch, case.heads, case.q_len, case.kv_len)
        if case.mask == "alibi":
            return alibi_bias(inputs).expand(case.batch, -1, -1, -1)
        return None

    def forward():
        out = xops.memory_efficient_attention(q, k, v, attn_bias=bias(), scale=inputs.scale)
        return out.transpose(1, 2)

    return forward, {}


# ------------------------------------------------------------------------ flash-attn


def _flash_attn(inputs: BenchInputs) -> Prepared:
    from flash_attn import flash_attn_func

    case = inputs.case
    q, k, v = (t.transpose(1, 2) for t in (inputs.query, inputs.key, inputs.value))
    kwargs: dict[str, object] = {"softmax_scale": inputs.scale, "causal": case.causal}
    if case.mask == "alibi":
        # flash-attn adds -slope·|i - j| (bottom-right aligned); with causal and Lq == Lk that is
        # slope·(j - i), the bias the other implementations get.
        if case.q_len != case.kv_len:
            raise Unsupported("ALiBi with Lq != Lk is aligned differently in flash-attn")
        assert inputs.slopes is not None, "make_inputs builds slopes for ALiBi cases"
        kwargs["alibi_slopes"] = inputs.slopes.float()
    elif case.causal and case.q_len != case.kv_len:
        raise Unsupported("flash-attn aligns causal bottom-right; SDPA's is_causal is top-left")

    def forward():
        return flash_attn_func(q, k, v, **kwargs).transpose(1, 2)

    return forward, {}


def _flash_attn_reasons(case: Case) -> list[str]:
    if case.head_dim > 256:
        return [f"head dim {case.head_dim} > 256"]
    return []


# ---------------------------------------------------------------------- FlexAttention

_FLEX: list = []


def _flex_call(q, k, v, score_mod, block_mask, scale):
    # Compiled as its own function (its own compile cache): after many cases in one worker,
    # torch.compile(flex_attention) itself would hit dynamo's recompile limit and run FlexAttention
    # eagerly, materializing the scores. Refuse that rather than measure it.
    if not torch.compiler.is_compiling():
        raise Unsupported("torch.compile did not compile FlexAttention (recompile limit hit?)")
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)


def _flex(inputs: BenchInputs) -> Prepared:
    from torch.nn.attention.flex_attention import create_block_mask

    if not _FLEX:
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _FLEX.append(torch.compile(_flex_call, fullgraph=True))
    compiled = _FLEX[0]
    case = inputs.case
    callbacks = user_callbacks(inputs)
    mask_mod = callbacks.get("mask_mod")
    block_mask = None
    if mask_mod is not None:
        # Built once here, outside the timed call, and reused: how FlexAttention is meant to be used.
        batch = case.batch if case.mask == "key-padding" else None
        block_mask = create_block_mask(mask_mod, batch, None, case.q_len, case.kv_len, device=inputs.query.device)
    q, k, v = inputs.query, inputs.key, inputs.value

    def forward():
        return compiled(q, k, v, callbacks.get("score_mod"), block_mask, inputs.scale)

    return forward, {}


def _flex_reasons(case: Case) -> list[str]:
    if case.backward and torch.device(case.device).type == "cpu":
        return ["FlexAttention has no backward on CPU"]
    return []


# --------------------------------------------------------------------------- subquad


def _subquad_call_kwargs(inputs: BenchInputs, backend: str) -> dict:
    case = inputs.case
    kwargs: dict = {"scale": inputs.scale, "backend": backend}
    if case.budget is not None:
        kwargs["memory_budget"] = case.budget
    if case.causal:
        kwargs["is_causal"] = True
    if case.mask == "key-padding":
        kwargs["attn_mask"] = inputs.pad_mask
    if case.mask == "softcap":
        kwargs["score_mod"] = _softcap  # no built-in: the user-written callback
    if case.mask in ("alibi", "window", "document"):
        mods = getattr(subquad, "mods", None)
        if mods is None:
            raise Unsupported("subquad.mods is not available in this subquad")
        if case.mask == "alibi":
            kwargs["score_mod"] = mods.alibi(inputs.slopes)
        elif case.mask == "window":
            kwargs.pop("is_causal")
            kwargs["mask_mod"] = mods.sliding_window(WINDOW, causal=True)
        else:
            kwargs["mask_mod"] = mods.document(inputs.doc_ids)
    return kwargs


def _softcap(score, b, h, q_idx, kv_idx):
    return SOFTCAP * torch.tanh(score / SOFTCAP)


def user_callbacks(inputs: BenchInputs) -> dict:
    """The case's masking written as a user would, FlexAttention-style: ``score_mod`` and
    ``mask_mod`` lambdas (the same functions the ``flex-compiled`` implementation gets)."""
    case = inputs.case
    slopes, ids = inputs.slopes, inputs.doc_ids
    causal = lambda b, h, q_idx, kv_idx: kv_idx <= q_idx  # noqa: E731
    if case.mask in ("causal", "alibi", "softcap"):
        out: dict[str, Callable[..., torch.Tensor]] = {"mask_mod": causal}
        if case.mask == "alibi":
            assert slopes is not None, "make_inputs builds slopes for ALiBi cases"
            out["score_mod"] = lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx)
        if case.mask == "softcap":
            out["score_mod"] = _softcap
        return out
    if case.mask == "window":
        return {"mask_mod": lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx <= WINDOW)}
    if case.mask == "document":
        assert ids is not None, "make_inputs builds doc_ids for document cases"
        return {"mask_mod": lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx]}
    if case.mask == "key-padding":
        assert inputs.kv_lengths is not None, "make_inputs builds kv_lengths for key-padding cases"
        lengths = inputs.kv_lengths.to(inputs.query.device)
        return {"mask_mod": lambda b, h, q_idx, kv_idx: kv_idx < lengths[b]}
    return {}


def _subquad(backend: str, user_written: bool = False) -> Callable[[BenchInputs], Prepared]:
    def prepare(inputs: BenchInputs) -> Prepared:
        try:
            attention = subquad.attention
        except AttributeError as exc:
            raise Unsupported(f"subquad.attention is not available ({exc})") from None
        if backend != "auto" and backend not in getattr(subquad, "BACKENDS", ()):
            raise Unsupported(f"subquad has no backend {backend!r}")
        q, k, v = inputs.query, inputs.key, inputs.value
        if user_written:
            kwargs = {"scale": inputs.scale, "backend": backend, **user_callbacks(inputs)}
            if inputs.case.budget is not None:
                kwargs["memory_budget"] = inputs.case.budget
        else:
            kwargs = _subquad_call_kwargs(inputs, backend)
        info = {}
        explain = getattr(subquad, "explain", None)
        if explain is not None:
            plan = explain(q, k, v, **kwargs)
            rejected = getattr(plan, "rejected", None) or {}
            if backend != "auto" and getattr(plan, "backend", None) != backend and rejected.get(backend):
                raise Unsupported("; ".join(rejected[backend]))
            info = describe_plan(plan)

        def forward():
            return attention(q, k, v, **kwargs)

        return forward, info

    return prepare


def describe_plan(plan) -> dict:
    """The parts of a subquad Plan worth recording next to a measurement."""
    info = {}
    for attr in (
        "backend",
        "chunk_size",
        "backward_backend",
        "backward_chunk_size",
        "predicted_peak_bytes",
        "budget_bytes",
    ):
        value = getattr(plan, attr, None)
        if isinstance(value, tuple):
            value = list(value)
        if value is not None:
            info[attr] = value if isinstance(value, (int, float, str, list)) else str(value)
    return info


def _subquad_impls() -> list[Impl]:
    backends = tuple(getattr(subquad, "BACKENDS", ())) or ("sdpa", "fused", "matmul")
    # A forced backend that cannot run raises NotImplementedError with its reasons; a budget too
    # small for any tile raises MemoryBudgetError. Both are refusals, not failures.
    refusals = (NotImplementedError,) + tuple(filter(None, [getattr(subquad, "MemoryBudgetError", None)]))
    out = [
        Impl("subquad", "subquad.attention, backend chosen by the planner", _subquad("auto"), refusals=refusals),
        Impl(
            "subquad-user",
            "subquad.attention with the masking as user-written score_mod/mask_mod lambdas, planner's choice",
            _subquad("auto", user_written=True),
            refusals=refusals,
        ),
    ]
    for name in backends:
        out.append(
            Impl(f"subquad-{name}", f"subquad.attention(backend={name!r}), forced", _subquad(name), refusals=refusals)
        )
    return out


# -------------------------------------------------------------------------- registry


def _registry() -> list[Impl]:
    sdpa_cuda_only = ("cuda",)
    return [
        Impl(
            "sdpa-flash",
            "SDPA, FLASH_ATTENTION backend (on CPU: the fused CPU kernel)",
            _sdpa("FLASH_ATTENTION"),
            devices=("cpu", "cuda"),
            masks=SDPA_MASKS,
        ),
        Impl(
            "sdpa-efficient",
            "SDPA, EFFICIENT_ATTENTION backend (memory-efficient kernel)",
            _sdpa("EFFICIENT_ATTENTION"),
            devices=sdpa_cuda_only,
            masks=SDPA_MASKS,
        ),
        Impl(
            "sdpa-cudnn",
            "SDPA, CUDNN_ATTENTION backend",
            _sdpa("CUDNN_ATTENTION"),
            devices=sdpa_cuda_only,
            masks=SDPA_MASKS,
        ),
        Impl(
            "sdpa-math",
            "SDPA, MATH backend (materializes the scores; on MPS: MPS's kernel)",
            _sdpa("MATH"),
            materializes_scores=True,
            masks=SDPA_MASKS,
        ),
        Impl(
            "xformers",
            "xformers.ops.memory_efficient_attention",
            _xformers,
            devices=("cuda", "cpu"),
            masks=("none", "causal", "key-padding", "alibi"),
            module="xformers",
            install="pip install xformers",
        ),
        Impl(
            "flash-attn",
            "flash_attn.flash_attn_func (FlashAttention-2)",
            _flash_attn,
            devices=("cuda",),
            dtypes=("fp16", "bf16"),
            masks=("none", "causal", "alibi"),
            module="flash_attn",
            install="pip install flash-attn",
            extra_reasons=_flash_attn_reasons,
        ),
        Impl(
            "naive", "softmax(q kᵀ · scale + mask) v, materialized in the input dtype", _naive, materializes_scores=True
        ),
        Impl(
            "flex-compiled",
            "torch.compile(flex_attention), the callbacks as lambdas, its BlockMask built once outside the timed call",
            _flex,
            devices=("cpu", "cuda"),
            dtypes=("fp16", "bf16", "fp32"),
            masks=("none", "causal", "key-padding", "alibi", "softcap", "window", "document"),
            module="torch.nn.attention.flex_attention",
            extra_reasons=_flex_reasons,
        ),
        *_subquad_impls(),
    ]


IMPLS: dict[str, Impl] = {impl.name: impl for impl in _registry()}


def select(patterns: Optional[list[str] | tuple[str, ...]]) -> list[Impl]:
    """Implementations whose name matches any of the fnmatch ``patterns`` (all for None), in
    registry order. Raises ValueError for a pattern that matches nothing."""
    if not patterns:
        return list(IMPLS.values())
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in IMPLS):
            raise ValueError(f"--impl {pattern!r} matches no implementation; known: {', '.join(IMPLS)}.")
    return [impl for name, impl in IMPLS.items() if any(fnmatch.fnmatchcase(name, p) for p in patterns)]


def refusal_reason(impl: Impl, exc: BaseException, warnings_text: str = "") -> Optional[str]:
    """The reason when ``exc`` is ``impl`` turning an input down (not a failure), else None."""
    if isinstance(exc, Unsupported):
        return str(exc)
    message = str(exc)
    if isinstance(exc, RuntimeError) and ("No available kernel" in message or "No viable backend" in message):
        # SDPA explains the refusal in warnings, one per backend; those are the useful part.
        return (warnings_text or message.splitlines()[0]).strip()
    if isinstance(exc, impl.refusals) and not isinstance(exc, OutOfMemoryError):
        return f"{type(exc).__name__}: {_one_line(message)}".strip()
    return None


def _one_line(message: str) -> str:
    """A multi-line refusal is usually a heading ending in ':' and one reason per line; the
    reasons are what a reader needs, so the heading goes."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        lines = lines[1:]
    return "; ".join(lines)


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, OutOfMemoryError):
        return True
    message = str(exc).lower()
    return isinstance(exc, (RuntimeError, MemoryError)) and (
        isinstance(exc, MemoryError)
        or "out of memory" in message
        or "can't allocate memory" in message
        or "not enough memory" in message
    )
