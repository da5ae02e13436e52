"""Which attention for this model, here: the node **Which attention? (subquad)** and what it measures.

Every attention this ComfyUI offers on this machine (its attention registry: ``pytorch``,
``sub_quad``, ``split``, and ``xformers``/``sage``/``flash`` where they import; another custom
node's entries too), and subquad with the default budget and with the cap, each runs one
denoising step of the user's own model (random latents and conditioning of the model's shapes,
through ``apply_model``: no sampler state), and optionally a VAE decode. Each candidate is a patch on
a clone (``transformer_options["optimized_attention_override"]``; the VAE's blocks by object patches),
so the model that came in is never changed.

The candidates run in interleaved rounds (each once per round, the order rotated and reversed from
round to round), and the verdicts are read from the per-round ratios to the fastest by the rule
``subquad bench`` names winners by (``compare_paired``: the order-statistic interval of the median
ratio, 99%, a winner named only beyond 3% and at 95% coverage, else "same within noise" or
"undecided"). Peak memory, by the bench's meters: the process's RSS high-water mark on CPU (Linux),
the allocator's peak on CUDA, the MPS driver's memory after the step on MPS. Both come from the
core (``_for_wings``), below the bench and the integrations alike.

The rest of the package may use :class:`Setting`, :class:`Row`, :class:`Which`, :func:`measure`,
:func:`patched`, :func:`table`, :func:`figure`, :func:`chart`, :func:`verdicts`, :class:`Meter`
and ``SAME``: the node (``_nodes``) and ``subquad bench --host comfyui`` (in a child process).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..._for_wings import (
    PRACTICAL,
    SAME,
    Budget,
    CudaPeak,
    MpsAfter,
    RssPeak,
    compare_paired,
    format_bytes,
    parse_budget,
    synchronize,
)
from ._attention import Override, VaeAttention
from ._hooks import ATTENTION, VAE, hooks, host, unsupported

FLAGS = {  # what makes an option ComfyUI's attention for every model (a restart with this flag)
    "pytorch": "--use-pytorch-cross-attention",
    "sub_quad": "--use-quad-cross-attention",
    "split": "--use-split-cross-attention",
    "sage": "--use-sage-attention",
    "flash": "--use-flash-attention",
    "xformers": "xformers installed (the default then; --disable-xformers turns it off)",
    "subquad": "SUBQUAD_COMFYUI_DEFAULT=1 in the environment",
}
VAE_FUNCTIONS = {"pytorch": "pytorch_attention", "split": "normal_attention", "xformers": "xformers_attention"}
REFERENCE_ORDER = ("pytorch", "subquad", "sub_quad", "split")  # the most exact first (float32 sums)


@dataclass
class Candidate:
    """One attention to try: ``fn`` is the model's ``optimized_attention_override`` (``part="step"``)
    or the VAE blocks' ``optimized_attention`` (``part="VAE decode"``)."""

    name: str
    part: str
    fn: Callable[..., Tensor]
    now: bool = False  # ComfyUI's own choice in this process
    budget: Budget = None


@dataclass
class Row:
    """One candidate's measurement. ``status``: ``ok``, ``out of memory``, ``refused`` or ``error``."""

    name: str
    part: str
    status: str = "ok"
    reason: str = ""
    times: List[float] = field(default_factory=list)  # seconds per step, one per round
    peak_bytes: Optional[int] = None
    diff: Optional[float] = None  # max |out - reference| / max |reference|
    over_cap: bool = False
    now: bool = False
    verdict: str = ""

    @property
    def seconds(self) -> Optional[float]:
        return float(statistics.median(self.times)) if self.times else None


@dataclass
class Which:
    """What the node found: rows per part, the recommended candidate of the step, and the setting."""

    rows: List[Row]
    recommended: Optional[str]
    setting: str
    meter: str
    reference: Dict[str, str]
    cap_bytes: Optional[int] = None
    chosen: Optional[Candidate] = None  # the recommended candidate: what the MODEL output runs


class HostOverride:
    """A host's registered attention as a model's ``optimized_attention_override``: ComfyUI's
    ``wrap_attn`` calls it with the chosen function's arguments, ``_inside_attn_wrapper`` among them,
    so the registered (wrapped) function runs its own code and does not look for an override again."""

    def __init__(self, name: str, fn: Callable[..., Tensor]) -> None:
        self.name, self.fn = name, fn

    def __call__(self, func: Callable[..., Tensor], *args: Any, **kwargs: Any) -> Tensor:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"ComfyUI's {self.name} attention"


def model_candidates(cap: Budget) -> List[Candidate]:
    """The attention functions of the running ComfyUI's registry (ours left out), then subquad with
    the default budget and, given a cap, with the cap as its budget."""
    attn = host(ATTENTION)
    registry = getattr(attn, "REGISTERED_ATTENTION_FUNCTIONS", None)
    if not isinstance(registry, dict):  # an older ComfyUI: its functions by name
        registry = {n: getattr(attn, f"attention_{n}") for n in ("pytorch", "sub_quad", "split")}
    now = getattr(attn, "optimized_attention", None)
    found = [
        Candidate(name, "step", HostOverride(name, fn), now=fn is now)
        for name, fn in registry.items()
        if name != "subquad" and callable(fn)
    ]
    found.append(Candidate("subquad", "step", Override(None)))
    if cap is not None:
        found.append(Candidate(f"subquad, budget {cap}", "step", Override(cap), budget=cap))
    return found


def vae_candidates(cap: Budget) -> List[Candidate]:
    """The VAE attentions ComfyUI has (``comfy.ldm.modules.diffusionmodules.model``), then subquad's."""
    vae = host(VAE)
    mm = host("comfy.model_management")
    now = vae.vae_attention() if callable(getattr(vae, "vae_attention", None)) else None
    found = []
    for name, attr in VAE_FUNCTIONS.items():
        fn = getattr(vae, attr, None)
        if fn is None or (name == "xformers" and not mm.xformers_enabled_vae()):
            continue
        found.append(Candidate(name, "VAE decode", fn, now=fn is now))
    found.append(Candidate("subquad", "VAE decode", VaeAttention(None)))
    if cap is not None:
        found.append(Candidate(f"subquad, budget {cap}", "VAE decode", VaeAttention(cap), budget=cap))
    return found


def patched(model: Any, candidate: Candidate) -> Any:
    """A clone of the ModelPatcher whose attention is ``candidate``'s; ``model`` is untouched."""
    clone = model.clone()
    clone.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = candidate.fn
    return clone


def patched_vae(vae: Any, candidate: Candidate) -> Any:
    """A shallow copy of a ComfyUI VAE whose attention blocks run ``candidate`` (object patches on a
    cloned patcher, as :func:`~._nodes.patch_vae` does); ``vae`` keeps its attention."""
    names = [n for n, m in vae.first_stage_model.named_modules() if hasattr(m, "optimized_attention")]
    out = copy.copy(vae)
    out.patcher = vae.patcher.clone()
    for name in names:
        out.patcher.add_object_patch(f"{name}.optimized_attention", candidate.fn)
    return out


# ----------------------------------------------------------------------------------- memory


class Meter:
    """Peak memory of one call above its start, read by ``subquad bench``'s meters: CUDA's allocator
    peak; MPS driver memory after the call (no peak counter); CPU RSS high-water mark (Linux).
    ``method`` says which in words; ``stop()`` is ``None`` where there is none."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.meter: Optional[Union[CudaPeak, MpsAfter, RssPeak]] = None
        self.method = ""
        if device.type == "cuda":
            self.meter, self.method = CudaPeak(device), "CUDA allocator peak (max_memory_allocated)"
        elif device.type == "mps":
            self.meter, self.method = MpsAfter(), "MPS driver memory after the step (no peak counter on MPS)"
        elif RssPeak.available() is None:
            self.meter, self.method = RssPeak(), "process RSS high-water mark"

    def start(self) -> None:
        if self.meter is not None:
            self.meter.start()

    def stop(self) -> Optional[int]:
        return self.meter.stop() if self.meter is not None else None


# ----------------------------------------------------------------------------------- timing


def orders(names: Sequence[str], rounds: int) -> List[List[str]]:
    """Round orders: rotated by one each round and reversed every other cycle, so every candidate
    takes every position and follows each neighbour from both sides."""
    n, out = len(names), []
    for r in range(rounds):
        order = list(names[r % n :]) + list(names[: r % n]) if n else []
        out.append(order[::-1] if (r // max(1, n)) % 2 else order)
    return out


def verdicts(samples: Mapping[str, Sequence[float]]) -> Dict[str, str]:
    """Each name's verdict against the fastest by median (per-round ratios of the same rounds,
    ``compare_paired``): ``"fastest"``, ``SAME``, ``"1.31x slower"`` or
    ``"undecided (1.08x): more rounds needed"``."""
    samples = {k: list(v) for k, v in samples.items() if v}
    if not samples:
        return {}
    medians = {k: statistics.median(v) for k, v in samples.items()}
    best = min(medians, key=medians.__getitem__)
    out = {best: "fastest"}
    for name, times in samples.items():
        if name == best:
            continue
        c = compare_paired(name, times, best, samples[best])
        if c.verdict == "slower":
            out[name] = f"{c.ratio:.2f}x slower"
        elif c.ratio > 1.0 + PRACTICAL:  # beyond the threshold, but its interval is not yet
            out[name] = f"undecided ({c.ratio:.2f}x): more rounds needed"
        else:
            out[name] = SAME
    return out


# ----------------------------------------------------------------------------------- running


@dataclass
class Setting:
    """What the node times: the size, the steps per call and the rounds, and how to report progress."""

    width: int = 512
    height: int = 512
    batch: int = 1
    steps: int = 1
    rounds: int = 6
    cap: Budget = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    progress: Callable[[int, int], None] = lambda done, total: None
    interrupted: Callable[[], None] = lambda: None  # raises to stop (ComfyUI's interrupt)
    clock: Callable[[], float] = time.perf_counter


def is_out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def model_step(model: Any, setting: Setting) -> Callable[[Any], Tensor]:
    """One denoising step of ``model`` as a KSampler step with CFG runs it (cond and uncond in one
    batch of ``2 * batch``): random latents and conditioning of the model's own shapes, through
    ``apply_model`` with the given clone's ``transformer_options``."""
    base = model.model
    fmt = base.latent_format
    scale = getattr(fmt, "spacial_downscale_ratio", 8)
    n = 2 * setting.batch
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, fmt.latent_channels, setting.height // scale, setting.width // scale, generator=g)
    extra: Dict[str, Tensor] = {}
    context_dim = (getattr(base, "model_config", None) and base.model_config.unet_config.get("context_dim")) or 768
    extra["c_crossattn"] = torch.randn(n, 77, context_dim, generator=g)
    if getattr(base, "adm_channels", 0):
        extra["y"] = torch.randn(n, base.adm_channels, generator=g)
    sigma = float(base.model_sampling.percent_to_sigma(0.5))
    device = model.load_device
    x, t = x.to(device), torch.full((n,), sigma, device=device)
    extra = {k: v.to(device) for k, v in extra.items()}

    def step(clone: Any) -> Tensor:
        options = clone.model_options.get("transformer_options", {})
        with torch.inference_mode():
            out: Tensor = base.apply_model(x, t, transformer_options=dict(options), **extra)
        return out

    return step


def vae_decode(vae: Any, setting: Setting) -> Callable[[Any], Tensor]:
    """One decode of random latents of the VAE's own channels at the setting's size."""
    channels = int(getattr(vae, "latent_channels", 4) or 4)
    scale = getattr(vae, "downscale_ratio", 8)
    scale = scale if isinstance(scale, int) else 8
    g = torch.Generator().manual_seed(1)
    latent = torch.randn(setting.batch, channels, setting.height // scale, setting.width // scale, generator=g)

    def decode(copy_: Any) -> Tensor:
        with torch.inference_mode():
            out: Tensor = copy_.decode(latent)
        return out

    return decode


def _first_run(row: Row, run: Callable[[], Tensor], meter: Meter) -> Optional[Tensor]:
    """The untimed first call: its output (for the differences) and its peak memory."""
    try:
        meter.start()
        out = run()
        row.peak_bytes = meter.stop()
        return out.float().cpu()
    except NotImplementedError as e:
        row.status, row.reason = "refused", _one_line(e)
    except Exception as e:  # an option that fails is a result to show, not a crash of the node
        if getattr(type(e), "__name__", "") == "InterruptProcessingException":
            raise
        row.status = "out of memory" if is_out_of_memory(e) else "error"
        row.reason = _one_line(e)
    return None


def _one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(' '.join(str(e).split()) or type(e).__name__)[:160]}"


def run_part(
    candidates: Sequence[Candidate],
    prepare: Callable[[Candidate], Any],
    run: Callable[[Any], Tensor],
    setting: Setting,
    tick: Callable[[], None],
) -> Tuple[List[Row], Optional[str]]:
    """Each candidate once (output, peak memory, refusals), then the ones that ran in
    ``setting.rounds`` interleaved rounds of ``setting.steps`` calls; differences from the most
    exact candidate that ran; verdicts against the fastest."""
    device = setting.device
    meter = Meter(device)
    rows: List[Row] = []
    outputs: Dict[str, Tensor] = {}
    prepared: Dict[str, Any] = {}
    cap = parse_budget(setting.cap) if setting.cap is not None else None
    for c in candidates:
        setting.interrupted()
        row = Row(c.name, c.part, now=c.now)
        rows.append(row)
        prepared[c.name] = ready = prepare(c)
        out = _first_run(row, lambda: run(ready), meter)  # noqa: B023 - called at once, in this iteration
        tick()
        if out is not None:
            outputs[c.name] = out
            row.over_cap = cap is not None and row.peak_bytes is not None and row.peak_bytes > cap
    ok = [r for r in rows if r.status == "ok"]
    for order in orders([r.name for r in ok], setting.rounds):
        for name in order:
            setting.interrupted()
            start = setting.clock()
            for _ in range(setting.steps):
                run(prepared[name])
            synchronize(device)
            next(r for r in ok if r.name == name).times.append((setting.clock() - start) / setting.steps)
            tick()
    reference = next((n for n in REFERENCE_ORDER if n in outputs), next(iter(outputs), None))
    for row in ok:
        ref = outputs[str(reference)]
        row.diff = float((outputs[row.name] - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    for name, verdict in verdicts({r.name: r.times for r in ok}).items():
        next(r for r in ok if r.name == name).verdict = verdict
    return rows, reference


def recommend(rows: Sequence[Row]) -> Optional[str]:
    """The fastest step within the cap; among the candidates the same within noise as it, the one
    with the smallest peak memory (the tie is said as such in the table)."""
    fits = [r for r in rows if r.part == "step" and r.status == "ok" and not r.over_cap and r.times]
    if not fits:
        return None
    marks = verdicts({r.name: r.times for r in fits})
    tied = [r for r in fits if marks[r.name] in ("fastest", SAME)]
    best = min(tied, key=lambda r: (r.peak_bytes if r.peak_bytes is not None else math.inf, r.seconds or 0.0))
    return best.name


def measure(model: Any, vae: Any, setting: Setting) -> Which:
    """Time every candidate on ``model`` (and ``vae``, if given) as :func:`run_part` does; returns the
    rows and the recommendation. Raises ComfyUI's interrupt when the user cancels; the model and the
    VAE that came in are unchanged either way (every candidate runs on a clone).

    Raises:
        HostUnsupported: a ComfyUI without ``wrap_attn`` (no per-model attention to compare).
    """
    found = hooks()
    if not found.override:
        raise unsupported(
            found,
            "to compare attentions on one model",
            "wrap_attn (transformer_options['optimized_attention_override'])",
        )
    host("comfy.model_management").load_models_gpu([model])
    setting.device = torch.device(model.load_device)
    parts = [(model_candidates(setting.cap), lambda c: patched(model, c), model_step(model, setting))]
    if vae is not None:
        parts.append((vae_candidates(setting.cap), lambda c: patched_vae(vae, c), vae_decode(vae, setting)))
    total = sum(len(c) for c, _, _ in parts) * (1 + setting.rounds)
    done = [0]

    def tick() -> None:
        done[0] += 1
        setting.progress(min(done[0], total), total)

    rows: List[Row] = []
    references: Dict[str, str] = {}
    for candidates, prepare, run in parts:
        part_rows, reference = run_part(candidates, prepare, run, setting, tick)
        rows += part_rows
        if reference is not None:
            references[candidates[0].part] = reference
    meter = Meter(setting.device).method or "none on this system"
    described = (
        f"{setting.width}x{setting.height} px, batch {setting.batch} (x2: cond and uncond), "
        f"{setting.steps} step{'s' * (setting.steps != 1)} per call, {setting.rounds} rounds, on {setting.device}"
    )
    cap = parse_budget(setting.cap) if setting.cap is not None else None
    best = recommend(rows)
    chosen = next((c for c in parts[0][0] if c.name == best), None)
    return Which(rows, best, described, meter, references, cap, chosen)


# ----------------------------------------------------------------------------------- showing


def _time(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def _label(row: Row) -> str:
    return row.name + (" (ComfyUI's now)" if row.now else "")


def table(which: Which) -> str:
    """The node's STRING: per part, each candidate's time per step, peak memory, difference and
    verdict; what did not run and why; the recommendation and how to make it every model's."""
    lines = [f"Which attention? {which.setting}", f"peak memory: {which.meter}"]
    if which.cap_bytes is not None:
        lines.append(f"memory cap: {format_bytes(which.cap_bytes)}")
    for part in dict.fromkeys(r.part for r in which.rows):
        rows = sorted((r for r in which.rows if r.part == part), key=lambda r: (r.seconds is None, r.seconds or 0))
        ref = which.reference.get(part, "-")
        what = "time/step" if part == "step" else "time"
        lines += ["", f"{part:<34} {what:>10} {'peak memory':>12} {'vs ' + ref:>12}  verdict"]
        for r in rows:
            if r.status != "ok":
                lines.append(f"  {_label(r):<32} {'-':>10} {'-':>12} {'-':>12}  did not run: {r.status}")
                continue
            memory = format_bytes(r.peak_bytes) if r.peak_bytes is not None else "-"
            mark = "  << recommended" if part == "step" and r.name == which.recommended else ""
            over = ", over the cap" if r.over_cap else ""
            diff = f"{r.diff:.1e}" if r.diff is not None else "-"
            lines.append(f"  {_label(r):<32} {_time(r.seconds):>10} {memory:>12} {diff:>12}  {r.verdict}{over}{mark}")
    failed = [r for r in which.rows if r.status != "ok"]
    if failed:
        lines += ["", "did not run:"] + [f"  {r.part}, {r.name}: {r.status}: {r.reason}" for r in failed]
    lines += [""] + _advice(which)
    return "\n".join(lines)


def _advice(which: Which) -> List[str]:
    best = which.recommended
    if best is None:
        return ["recommended: none (no candidate ran within the cap)"]
    row = next(r for r in which.rows if r.part == "step" and r.name == best)
    tied = [r.name for r in which.rows if r.part == "step" and r.verdict == SAME and r.name != best]
    tied += [r.name for r in which.rows if r.part == "step" and r.verdict == "fastest" and r.name != best]
    why = f"the fastest within the cap, {_time(row.seconds)} per step"
    if any(r.verdict.startswith("undecided") for r in which.rows if r.part == "step" and not r.over_cap):
        why = f"the fastest median within the cap, {_time(row.seconds)} per step; more rounds would make it sure"
    if tied:
        why = f"{SAME} as {', '.join(tied)}; of those it needs the least memory"
    flag = FLAGS.get(best.split(",")[0], "the option that registered it")
    return [
        f"recommended: {best} ({why})",
        "  this node's MODEL output runs it (the model that came in is unchanged);",
        f"  for every model: restart ComfyUI with {flag}",
    ]


def figure(which: Which) -> Any:
    """The chart (a matplotlib figure): per part, time per step and peak memory per candidate, the
    recommended one marked, ties said as such, what did not run and why. ``None`` without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional: the chart only
        from matplotlib.figure import Figure  # optional: the chart only
    except ImportError:
        return None
    parts = list(dict.fromkeys(r.part for r in which.rows))
    failed = [r for r in which.rows if r.status != "ok"]
    height = sum(0.9 + 0.42 * len([r for r in which.rows if r.part == p]) for p in parts) + 1.3 + 0.25 * len(failed)
    fig = Figure(figsize=(11, height), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(parts), 2, squeeze=False, gridspec_kw={"wspace": 0.55, "hspace": 0.5})
    for i, part in enumerate(parts):
        _bars(which, part, axes[i][0], axes[i][1])
    fig.suptitle(f"Which attention? {which.setting}", fontsize=11, x=0.02, ha="left")
    notes = _advice(which)[:1] + [f"not run: {r.name} ({r.part}): {r.status}: {r.reason[:90]}" for r in failed]
    fig.text(0.02, 0.01, "\n".join(notes), fontsize=8.5, va="bottom", ha="left")
    fig.subplots_adjust(left=0.2, right=0.97, top=1 - 0.55 / height, bottom=(0.45 + 0.2 * len(notes)) / height)
    return fig


def _bars(which: Which, part: str, left: Any, right: Any) -> None:
    rows = [r for r in which.rows if r.part == part and r.status == "ok"]
    rows.sort(key=lambda r: r.seconds or 0, reverse=True)
    names = [_label(r) for r in rows]
    colours = ["#2a9d4b" if part == "step" and r.name == which.recommended else "#4c78a8" for r in rows]
    times = [r.seconds or 0 for r in rows]
    left.barh(names, times, color=colours)
    for y, r in enumerate(rows):
        tag = r.verdict.split(":")[0]
        if part == "step" and r.name == which.recommended:
            tag = "recommended" + (f" ({SAME} as the fastest)" if r.verdict == SAME else "")
        left.text(times[y], y, f" {_time(r.seconds)}  {tag}", va="center", fontsize=8)
    left.set_xlim(0, max(times or [1]) * 2.2)
    left.set_xlabel("seconds", fontsize=8)
    left.set_title(
        f"{part}: time per {'step' if part == 'step' else 'call'} (shorter is faster)", fontsize=9.5, loc="left"
    )
    memory = [(r.peak_bytes or 0) / 2**20 for r in rows]
    right.barh(names, memory, color=["#c44e52" if r.over_cap else c for r, c in zip(rows, colours)])
    for y, r in enumerate(rows):
        text = format_bytes(r.peak_bytes) if r.peak_bytes is not None else "not measured"
        right.text(memory[y], y, f" {text}" + (" over the cap" if r.over_cap else ""), va="center", fontsize=8)
    if which.cap_bytes is not None:
        right.axvline(which.cap_bytes / 2**20, color="#c44e52", linestyle="--", linewidth=1)
    right.set_xlim(0, max(memory + [1.0]) * 1.7)
    right.set_title(f"peak memory, MiB ({which.meter})", fontsize=9.5, loc="left")
    right.set_yticks(range(len(rows)), [""] * len(rows))


def chart(which: Which) -> Tensor:
    """The chart as ComfyUI's IMAGE: ``[1, H, W, 3]`` float32 in 0..1 (a blank image without matplotlib)."""
    fig = figure(which)
    if fig is None:
        return torch.ones(1, 64, 64, 3)
    fig.canvas.draw()
    rgba = torch.frombuffer(bytearray(fig.canvas.buffer_rgba()), dtype=torch.uint8)
    width, height = fig.canvas.get_width_height()
    return rgba.reshape(1, height, width, 4)[..., :3].float() / 255.0
