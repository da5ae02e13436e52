"""What is measured: cases (one shape, dtype, mask and mode on one device) and named presets.

Shape letters follow ``torch.nn.functional.scaled_dot_product_attention``: B batch, H heads,
Lq query length, Lk key length, E head dim. Query, key and value are all ``(B, H, L, E)``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

DTYPES = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp64": torch.float64,
}
_DTYPE_ALIASES = {
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float": "fp32",
    "float64": "fp64",
    "double": "fp64",
}

MASKS = ("none", "causal", "key-padding", "alibi", "softcap", "window", "document")
"""``causal`` is top-left aligned like SDPA's ``is_causal``; ``key-padding`` hides the last 25% of
the keys of every batch entry; ``alibi`` is causal attention plus an ALiBi bias
``slope_h * (kv_idx - q_idx)``, the way ALiBi language models use it; ``softcap`` is causal
attention with Gemma 2's soft-cap ``50·tanh(score / 50)`` on the scaled scores; ``window`` is
causal attention over the last 512 keys (Mistral's sliding window); ``document`` is 4 packed
documents of equal length, each query seeing the keys of its own document."""

PADDED_FRACTION = 0.25
SOFTCAP = 50.0
WINDOW = 512
DOCUMENTS = 4


def parse_dtype(name: str) -> str:
    """Canonical dtype name (``fp16``, ``bf16``, ``fp32``, ``fp64``) for a user's spelling."""
    key = name.strip().lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"Unknown dtype {name!r}; expected one of {', '.join(DTYPES)}.")
    return key


def parse_shape(text: str) -> tuple[int, int, int, int, int]:
    """``"B,H,Lq,Lk,E"`` or ``"B,H,L,E"`` (``x`` also separates) → ``(B, H, Lq, Lk, E)``."""
    parts = text.replace("x", ",").replace("X", ",").split(",")
    try:
        dims = [int(p) for p in parts if p.strip()]
    except ValueError:
        dims = []
    if len(dims) == 4:
        dims = [dims[0], dims[1], dims[2], dims[2], dims[3]]
    if len(dims) != 5 or min(dims) < 1:
        raise ValueError(
            f"Expected a shape B,H,Lq,Lk,E (or B,H,L,E) of positive integers, got {text!r}; "
            "for example 2,8,4096,4096,64."
        )
    return tuple(dims)  # type: ignore[return-value]


def default_dtype(device: str) -> str:
    """fp16 where half precision is fast (CUDA, MPS), fp32 on CPU."""
    return "fp32" if torch.device(device).type == "cpu" else "fp16"


@dataclass(frozen=True)
class Case:
    """One measurement setting: a shape, a dtype, a mask, forward or forward+backward, a device."""

    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    dtype: Optional[str] = None  # None: the device's default_dtype, resolved by resolve()
    mask: str = "none"
    backward: bool = False
    device: str = "cpu"
    budget: Optional[str] = None  # memory_budget handed to subquad, e.g. "512MiB"

    def __post_init__(self):
        if self.mask not in MASKS:
            raise ValueError(f"Unknown mask {self.mask!r}; expected one of {', '.join(MASKS)}.")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"Unknown dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}.")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.batch, self.heads, self.q_len, self.kv_len, self.head_dim)

    @property
    def mode(self) -> str:
        return "fwd+bwd" if self.backward else "fwd"

    @property
    def causal(self) -> bool:
        return self.mask in ("causal", "alibi", "softcap", "window")

    @property
    def density(self) -> float:
        """The fraction of the ``Lq x Lk`` scores the mask leaves visible (top-left aligned)."""
        lq, lk = self.q_len, self.kv_len
        if self.mask == "window":
            seen = sum(min(i, lk - 1) - max(0, i - WINDOW) + 1 for i in range(min(lq, lk)))
            seen += max(0, lq - lk) * (WINDOW + 1)
            return seen / (lq * lk)
        if self.mask == "document":
            return 1.0 / DOCUMENTS
        return 0.5 if self.causal else 1.0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype or default_dtype(self.device)]

    @property
    def name(self) -> str:
        """Readable id without the mode, e.g. ``1x4x1024x1024x64 fp32 causal``."""
        text = f"{'x'.join(map(str, self.shape))} {self.dtype or default_dtype(self.device)} {self.mask}"
        return f"{text} budget={self.budget}" if self.budget else text

    @property
    def score_elements(self) -> int:
        """B·H·Lq·Lk: the size of the score matrix a materializing implementation builds."""
        return self.batch * self.heads * self.q_len * self.kv_len

    @property
    def flops(self) -> float:
        """4·B·H·Lq·Lk·E (two matmuls) times the visible fraction (½ causal, less for windows and
        documents), ×3.5 for forward+backward."""
        flops = 4.0 * self.score_elements * self.head_dim * self.density
        if self.backward:
            flops *= 3.5
        return flops

    @property
    def output_bytes(self) -> int:
        itemsize = self.torch_dtype.itemsize
        return self.batch * self.heads * self.q_len * self.head_dim * itemsize

    def resolve(self, device: str) -> "Case":
        """This case on ``device`` with its dtype made explicit."""
        return dataclasses.replace(self, device=device, dtype=self.dtype or default_dtype(device))


class Timing(NamedTuple):
    """How long to measure: warm up for ``warmup_s`` (at least one call), then repeat until
    ``target_s`` has been spent in timed calls, with at least ``min_reps`` and at most
    ``max_reps`` of them. A call slower than ``target_s`` is timed once."""

    warmup_s: float = 0.2
    target_s: float = 1.0
    min_reps: int = 5
    max_reps: int = 100


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    cases: tuple[Case, ...]
    impls: Optional[tuple[str, ...]] = None  # fnmatch patterns; None: every implementation
    timing: Timing = Timing()


def _cases(shapes, dtype=None, masks=("none",), backward=False):
    out = []
    for mask in masks:
        for b, h, lq, lk, e in shapes:
            out.append(Case(b, h, lq, lk, e, dtype=dtype, mask=mask, backward=backward))
    return tuple(out)


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            "quick",
            "A sweep of sequence lengths plus one case per mask and a backward, sized to finish "
            "in under 2 minutes on a 2-core CPU (fp32 there, fp16 elsewhere).",
            _cases([(1, 4, n, n, 64) for n in (512, 1024, 2048, 4096)])
            + _cases([(1, 4, 2048, 2048, 64)], masks=("causal", "key-padding", "alibi"))
            + _cases([(1, 4, 1024, 1024, 64)], backward=True),
            impls=("sdpa-*", "xformers", "flash-attn", "naive", "subquad*"),
            # 5 rounds at least: with 3 the interleaved verdict needs every round to agree.
            timing=Timing(warmup_s=0.05, target_s=0.3, min_reps=5, max_reps=20),
        ),
        Preset(
            "sdpa-vs-xformers",
            "32x32x1024x32 fp16, the shape of the PyTorch SDPA vs xformers comparison thread.",
            _cases([(32, 32, 1024, 1024, 32)], dtype="fp16"),
        ),
        Preset(
            "sd21-512",
            "Stable Diffusion 2.1 at 512 px: 64x64 latent = 4096 tokens, 5 heads of 64, batch 2 "
            "(classifier-free guidance), fp16.",
            _cases([(2, 5, 4096, 4096, 64)], dtype="fp16"),
        ),
        Preset(
            "sd15-1024",
            "Stable Diffusion 1.5 at 1024 px: 128x128 latent = 16384 tokens, 8 heads of 40, batch 2, fp16.",
            _cases([(2, 8, 16384, 16384, 40)], dtype="fp16"),
        ),
        Preset(
            "long-context",
            "A long-context transformer layer: 1x8x65536x64 bf16.",
            _cases([(1, 8, 65536, 65536, 64)], dtype="bf16"),
        ),
        Preset(
            "training",
            "Training step, forward+backward: 4x16x4096x64 bf16.",
            _cases([(4, 16, 4096, 4096, 64)], dtype="bf16", backward=True),
        ),
        Preset(
            "callbacks",
            "score_mod/mask_mod: causal + ALiBi 1x4x8192x64, causal + soft-cap 1x4x4096x64, a causal "
            "sliding window of 512 and 4 documents at 1x4x8192x64; fp32 and bf16, forward and "
            "forward+backward. subquad with its built-ins and with user-written lambdas, against SDPA "
            "with the materialized mask and torch.compile(flex_attention) with a reused BlockMask.",
            tuple(
                case
                for dtype in ("fp32", "bf16")
                for backward in (False, True)
                for case in _cases([(1, 4, 8192, 8192, 64)], dtype=dtype, masks=("alibi",), backward=backward)
                + _cases([(1, 4, 4096, 4096, 64)], dtype=dtype, masks=("softcap",), backward=backward)
                + _cases([(1, 4, 8192, 8192, 64)], dtype=dtype, masks=("window", "document"), backward=backward)
            ),
            impls=("sdpa-flash", "sdpa-math", "naive", "flex-compiled", "subquad", "subquad-user"),
            timing=Timing(warmup_s=0.1, target_s=0.5, min_reps=3, max_reps=10),
        ),
    )
}


def preset_cases(
    preset: Preset,
    device: str,
    *,
    dtype: Optional[str] = None,
    masks: Optional[list[str]] = None,
    backward: Optional[bool] = None,
    budget: Optional[str] = None,
) -> list[Case]:
    """The preset's cases on ``device``, with the command line's overrides applied (duplicates
    that an override creates are dropped, order kept)."""
    out: list[Case] = []
    for case in preset.cases:
        variants = masks or [case.mask]
        for mask in variants:
            c = dataclasses.replace(
                case,
                dtype=dtype or case.dtype,
                mask=mask,
                backward=case.backward if backward is None else backward,
                budget=budget,
            ).resolve(device)
            if c not in out:
                out.append(c)
    return out


def shape_cases(
    shapes: list[tuple[int, int, int, int, int]],
    device: str,
    *,
    dtype: Optional[str] = None,
    masks: Optional[list[str]] = None,
    backward: bool = False,
    budget: Optional[str] = None,
) -> list[Case]:
    """Cases for shapes given with ``--shape``."""
    out = []
    for mask in masks or ["none"]:
        for b, h, lq, lk, e in shapes:
            c = Case(b, h, lq, lk, e, dtype=dtype, mask=mask, backward=backward, budget=budget)
            c = c.resolve(device)
            if c not in out:
                out.append(c)
    return out


# ----------------------------------------------------------------------------- inputs


@dataclass
class BenchInputs:
    """Tensors of one case. ``pad_mask`` (B, 1, 1, Lk) is True where a key is attended
    (key-padding only); ``slopes`` (H,) float32 are the ALiBi slopes (alibi only)."""

    case: Case
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    grad_out: Optional[torch.Tensor]
    scale: float
    kv_lengths: Optional[torch.Tensor] = None
    pad_mask: Optional[torch.Tensor] = None
    slopes: Optional[torch.Tensor] = None
    doc_ids: Optional[torch.Tensor] = None  # (L,) document of each position (document only)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The geometric ALiBi slopes 2^(-8/n), 2^(-16/n), … for n = the next power of two, with
    the interleaved extra slopes of the ALiBi paper when ``num_heads`` is not a power of two."""
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    if n < num_heads:
        extra = [2.0 ** (-4.0 * (i + 1) / n) for i in range(2 * n)][0::2]
        slopes += extra[: num_heads - n]
    return torch.tensor(slopes, dtype=torch.float32)


def make_inputs(case: Case, seed: int = 0) -> BenchInputs:
    """Random inputs for ``case`` on its device (standard normal, as in the PyTorch tests)."""
    device = torch.device(case.device)
    dtype = case.torch_dtype
    gen = torch.Generator(device="cpu").manual_seed(seed)
    b, h, lq, lk, e = case.shape

    def randn(*shape):
        # Generated on the CPU so that every device sees the same numbers for a seed.
        t = torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)
        return t.to(device)

    query, key, value = randn(b, h, lq, e), randn(b, h, lk, e), randn(b, h, lk, e)
    grad_out = None
    if case.backward:
        for t in (query, key, value):
            t.requires_grad_(True)
        grad_out = randn(b, h, lq, e)
    inputs = BenchInputs(case, query, key, value, grad_out, scale=1.0 / math.sqrt(e))
    if case.mask == "key-padding":
        valid = max(1, math.ceil(lk * (1.0 - PADDED_FRACTION)))
        inputs.kv_lengths = torch.full((b,), valid, dtype=torch.long)
        inputs.pad_mask = (torch.arange(lk) < valid).view(1, 1, 1, lk).expand(b, 1, 1, lk)
        inputs.pad_mask = inputs.pad_mask.contiguous().to(device)
    if case.mask == "alibi":
        inputs.slopes = alibi_slopes(h).to(device)
    if case.mask == "document":
        inputs.doc_ids = (torch.arange(max(lq, lk)) * DOCUMENTS // max(lq, lk)).to(device)
    return inputs


def dense_keep(inputs: BenchInputs) -> torch.Tensor:
    """The mask of a window/document/causal case as a ``(Lq, Lk)`` bool tensor (True = attend):
    what SDPA and naive attention need to be given."""
    case = inputs.case
    device = inputs.query.device
    i = torch.arange(case.q_len, device=device).view(-1, 1)
    j = torch.arange(case.kv_len, device=device).view(1, -1)
    if case.mask == "document":
        assert inputs.doc_ids is not None  # made for document cases
        return inputs.doc_ids[: case.q_len].view(-1, 1) == inputs.doc_ids[: case.kv_len].view(1, -1)
    keep = j <= i
    if case.mask == "window":
        keep &= j >= i - WINDOW
    return keep


def alibi_bias(inputs: BenchInputs) -> torch.Tensor:
    """The causal ALiBi bias materialized as a (1, H, Lq, Lk) tensor of the input dtype, −inf
    above the diagonal: what SDPA and naive attention need to be given."""
    case = inputs.case
    device = inputs.query.device
    i = torch.arange(case.q_len, device=device).view(-1, 1)
    j = torch.arange(case.kv_len, device=device).view(1, -1)
    bias = torch.empty((1, case.heads, case.q_len, case.kv_len), dtype=case.torch_dtype, device=device)
    assert inputs.slopes is not None  # made for ALiBi cases
    # Written through out= so that no float32 (H, Lq, Lk) temporary is made on the way.
    torch.mul(inputs.slopes.view(1, -1, 1, 1), (j - i).to(torch.float32), out=bias)
    return bias.masked_fill_(j > i, float("-inf"))
