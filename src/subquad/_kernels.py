"""Chunk kernels: compute one block of query rows against a list of key segments.

Two kernels share one interface:

* :class:`MatmulKernel` -- pure PyTorch (``bmm``/``baddbmm``), any device, dtype and head dim, with
  dropout, ``score_mod`` and ``mask_mod``. Online softmax with float32 statistics.
* :class:`FusedCPUKernel` -- PyTorch's fused CPU flash kernel per segment, which returns each
  segment's log-sum-exp; segments are merged exactly by their lse.

A kernel's ``forward_rows`` writes ``out[:, :, qs:qe]`` and returns the rows' lse; its
``backward_rows`` accumulates dQ, dK, dV (and the float mask's gradient) for those rows.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from ._inputs import Inputs

NEG_INF = float("-inf")


class KernelRefused(RuntimeError):
    """A fused kernel refused an input the planner expected it to take (its message is the kernel's)."""


def is_oom(e: BaseException) -> bool:
    """A real allocator out-of-memory error (not one raised by a user callback)."""
    if from_callback(e):
        return False
    if isinstance(e, MemoryError) and type(e).__name__ != "MemoryBudgetError":
        return True
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(e, oom_type):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and (
        "out of memory" in msg or "can't allocate memory" in msg or "not enough memory" in msg
    )


def from_callback(e: BaseException) -> bool:
    """Whether ``e`` was raised by a user's ``score_mod``/``mask_mod`` (it must then propagate as is)."""
    return bool(getattr(e, "_subquad_from_callback", False))


def call_user(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a user callback; an exception it raises is marked so that no retry or fallback hides it."""
    try:
        return fn(*args)
    except Exception as e:
        try:
            e._subquad_from_callback = True  # type: ignore[attr-defined]
        except Exception:  # an exception type without attributes: it still propagates unchanged
            pass
        raise


def _call_kernel(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A private fused kernel; its refusals (not its out-of-memory errors) become :class:`KernelRefused`."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        if is_oom(e):
            raise
        raise KernelRefused(str(e)) from e


class Segment(NamedTuple):
    """A run of keys ``[ks, ke)`` for one block of query rows ``[qs, qe)``.

    ``causal``: ``"none"`` (no key is in the future of any query row), ``"diag"`` (``ks == qs``: the
    top-left causal mask of the tile is the global one) or ``"partial"`` (needs a generated mask).
    ``mask_mod``: whether ``mask_mod`` must be evaluated on this tile (False when the tile is known
    to be fully visible).
    """

    ks: int
    ke: int
    causal: str = "none"
    mask_mod: bool = False
    keep: Optional[Tensor] = None  # mask_mod already evaluated on this tile, if it was


class RowState(NamedTuple):
    """Online-softmax state of a block of query rows, updated in place tile by tile."""

    m: Tensor  # running max of the scores, (BHk, G*qn)
    l: Tensor  # running sum of exp(score - m)
    acc: Tensor  # running sum of exp(score - m) @ V, (BHk, G*qn, Ev)


# ------------------------------------------------------------------ helpers
def _index_grids(inp: Inputs, qs: int, qe: int, ks: int, ke: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """FlexAttention-style broadcastable int64 indices: b (B,1,1,1), h (1,Hq,1,1), q (1,1,qn,1), kv (1,1,1,kn)."""
    dev = inp.device
    b = torch.arange(inp.b_offset, inp.b_offset + inp.B, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(inp.Hq, device=dev).view(1, -1, 1, 1)
    qi = torch.arange(qs, qe, device=dev).view(1, 1, -1, 1)
    ki = torch.arange(ks, ke, device=dev).view(1, 1, 1, -1)
    return b, h, qi, ki


def eval_mask_mod(inp: Inputs, qs: int, qe: int, ks: int, ke: int) -> Tensor:
    """``mask_mod`` on one tile, checked: a bool tensor broadcastable to ``(B, Hq, qn, kn)``."""
    assert inp.mask_mod is not None
    b, h, qi, ki = _index_grids(inp, qs, qe, ks, ke)
    keep = call_user(inp.mask_mod, b, h, qi, ki)
    if not isinstance(keep, Tensor) or keep.dtype != torch.bool:
        got = keep.dtype if isinstance(keep, Tensor) else type(keep).__name__
        raise TypeError(f"mask_mod must return a bool tensor (True = attend), got {got}.")
    try:
        torch.broadcast_shapes(keep.shape, (inp.B, inp.Hq, qe - qs, ke - ks))
    except RuntimeError:
        raise ValueError(
            f"mask_mod returned shape {tuple(keep.shape)}, which does not broadcast to the tile "
            f"{(inp.B, inp.Hq, qe - qs, ke - ks)} (B, Hq, q_chunk, kv_chunk)."
        ) from None
    return keep


def apply_score_mod(
    inp: Inputs, s4: Tensor, qs: int, qe: int, ks: int, ke: int, mode: Optional[TorchFunctionMode] = None
) -> Tensor:
    """``score_mod`` on one tile of scores ``(B, Hq, qn, kn)``, checked (``mode`` active inside the callback)."""
    assert inp.score_mod is not None
    b, h, qi, ki = _index_grids(inp, qs, qe, ks, ke)
    with mode if mode is not None else contextlib.nullcontext():
        new = call_user(inp.score_mod, s4, b, h, qi, ki)
    if not isinstance(new, Tensor):
        raise TypeError(f"score_mod must return a tensor, got {type(new).__name__}.")
    if new.shape != s4.shape:
        try:
            new = new.expand(s4.shape)
        except RuntimeError:
            raise ValueError(
                f"score_mod returned shape {tuple(new.shape)}, expected the score tile's shape {tuple(s4.shape)}."
            ) from None
    if new.dtype != s4.dtype:
        raise TypeError(
            f"score_mod must return scores of the dtype it was given ({s4.dtype}), got {new.dtype}; "
            f"cast captured tensors, e.g. table.to(score.dtype)."
        )
    return new


def _hash32(x: Tensor) -> Tensor:
    # A 32-bit integer mix (two multiply-xorshift rounds); int64 arithmetic never overflows here
    # because x < 2**32 and the multiplier < 2**27.
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    return (x >> 16) ^ x


def dropout_scale(inp: Inputs, seed: int, qs: int, qe: int, ks: int, ke: int, dtype: torch.dtype) -> Tensor:
    """Dropout multipliers of a tile: 0 or 1/(1-p), a pure function of (seed, b, h, q, kv).

    Counter-based, so forward and backward regenerate the same mask whatever the tiling.
    ``dropout_p = 1`` drops everything (SDPA's output is then 0, as here).
    """
    b, h, qi, ki = _index_grids(inp, qs, qe, ks, ke)
    x = _hash32((b * inp.Hq + h + seed) & 0xFFFFFFFF)
    x = _hash32(x ^ qi)
    x = _hash32(x ^ (ki * 0x9E3779B1 & 0xFFFFFFFF))
    threshold = int(inp.dropout_p * 4294967296.0)  # p * 2**32
    keep = x >= threshold
    return keep.to(dtype) * (1.0 / (1.0 - inp.dropout_p) if inp.dropout_p < 1.0 else 0.0)


def reduce_to(t: Tensor, shape: Sequence[int]) -> Tensor:
    """``t`` summed over the dims where ``shape`` is 1: the gradient of a broadcast input."""
    dims = [i for i, (want, got) in enumerate(zip(shape, t.shape)) if want == 1 and got != 1]
    return t.sum(dim=dims, keepdim=True) if dims else t


def add_into(target: Tensor, value: Tensor) -> None:
    """``target += value``, summing ``value`` over the dims where ``target`` is broadcast."""
    target += reduce_to(value, target.shape).to(target.dtype)


def tile_bias(
    inp: Inputs, qs: int, qe: int, seg: Segment, dtype: torch.dtype, causal_in_kernel: bool = False
) -> Optional[Tensor]:
    """Everything added to a tile's scores as one tensor: ``attn_mask``, causal and ``mask_mod``.

    Broadcastable to ``(B, Hq, qn, kn)``; masked entries are ``-inf``. ``None`` when nothing is
    added.
    """
    ks, ke = seg.ks, seg.ke
    bias: Optional[Tensor] = None
    if inp.attn_mask is not None:
        m = inp.mask_tile(qs, qe, ks, ke)
        if m.dtype == torch.bool:
            bias = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(m.logical_not(), NEG_INF)
        else:
            bias = m.to(dtype)
    keep: Optional[Tensor] = None
    if seg.causal == "partial" or (seg.causal == "diag" and not causal_in_kernel):
        keep = inp.causal_visible(qs, qe, ks, ke)
    if seg.mask_mod:
        mm = seg.keep if seg.keep is not None else eval_mask_mod(inp, qs, qe, ks, ke)
        keep = mm if keep is None else keep & mm
    if keep is not None:
        if bias is None:
            bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(keep.logical_not(), NEG_INF)
        else:
            bias = bias.masked_fill(keep.logical_not(), NEG_INF)
    return bias


# ------------------------------------------------------------------ tensors captured by score_mod
class UncapturedGradientError(RuntimeError):
    """A ``score_mod`` read a tensor that requires grad which subquad's probe of it did not see."""


class _RecordGradTensors(TorchFunctionMode):
    """Collects every tensor that requires grad and is an argument of a torch function.

    Run under ``no_grad``: nothing created inside then requires grad, so each one found comes from
    outside the callback, however it got there (closure, global, ``functools.partial``, bound
    method, module attribute, container, a view or a tensor derived from a parameter).
    """

    def __init__(self) -> None:
        super().__init__()
        self.found: Dict[int, Tensor] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for x in tree_flatten((args, kwargs))[0]:
            if isinstance(x, Tensor) and x.requires_grad:
                self.found.setdefault(id(x), x)
        return func(*args, **kwargs)


def probe_captured(inp: Inputs) -> List[Tensor]:
    """Tensors requiring grad that ``score_mod`` reads, found by running it once on a tiny tile.

    The tile holds the first and last query and key (callbacks that index tables with positions
    touch both ends). A tensor read only on other tiles is caught by the backward, which raises
    rather than drop its gradient (:class:`UncapturedGradientError`).
    """
    if inp.score_mod is None or inp.B * inp.Hq * inp.Lq * inp.Lk == 0:
        return []
    dev = inp.device
    b = torch.arange(inp.b_offset, inp.b_offset + inp.B, device=dev).view(-1, 1, 1, 1)
    h = torch.arange(inp.Hq, device=dev).view(1, -1, 1, 1)
    qi = torch.tensor(sorted({0, inp.Lq - 1}), device=dev).view(1, 1, -1, 1)
    ki = torch.tensor(sorted({0, inp.Lk - 1}), device=dev).view(1, 1, 1, -1)
    score = torch.zeros(inp.B, inp.Hq, qi.shape[2], ki.shape[3], dtype=inp.stats_dtype, device=dev)
    recorder = _RecordGradTensors()
    with torch.no_grad(), recorder:
        call_user(inp.score_mod, score, b, h, qi, ki)
    return list(recorder.found.values())


class _CapturedAsLeaves(TorchFunctionMode):
    """Inside ``score_mod``, reads of a captured tensor see a detached leaf standing for it.

    The pulled-back gradient then stops at each captured tensor: the autograd Function returns
    it as that tensor's gradient and autograd carries it on to the tensor's sources once. (A
    gradient taken through the real tensor would also flow into its sources here, counting a
    parameter twice when a view or a derived tensor of it is captured as well, and would
    traverse their graph once per tile.)
    """

    def __init__(self, proxies: Dict[int, Tensor], known: Sequence[Tensor]) -> None:
        super().__init__()
        self.proxies = proxies
        self.known: Dict[int, Tensor] = {id(t): t for t in known}

    def _swap(self, x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        proxy = self.proxies.get(id(x))
        if proxy is not None:
            return proxy
        if x.requires_grad and id(x) not in self.known:
            raise UncapturedGradientError(
                f"score_mod read a tensor that requires grad ({tuple(x.shape)}, {x.dtype}) on a tile where "
                "subquad's probe of the callback (its first and last query and key) did not see it, so its "
                "gradient cannot be returned. Read every learnable tensor on every tile (e.g. index it "
                "with the tile's positions), or detach it if it needs no gradient."
            )
        return x

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = tree_map(self._swap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                self.known[id(t)] = t
        return out


# ------------------------------------------------------------------ matmul kernel
class MatmulKernel:
    """Pure-PyTorch tiles: ``bmm`` for scores, online softmax in float32, ``baddbmm`` into the accumulator."""

    name = "matmul"

    @staticmethod
    def compute_dtype(inp: Inputs) -> torch.dtype:
        # Half-precision matmuls on CPU are slow and overflow-prone; upcast tiles there.
        if inp.device.type == "cpu" and inp.dtype in (torch.float16, torch.bfloat16):
            return torch.float32
        return inp.dtype

    def _scaled_q(self, inp: Inputs, qs: int, qe: int, cdt: torch.dtype) -> Tensor:
        # Scaling q (qn x E) is cheaper than scaling the scores (qn x kn), and keeps fp16 scores in range.
        q_t = torch.mul(inp.q[:, :, qs:qe].to(cdt), inp.scale)
        return q_t.reshape(inp.B * inp.Hk, inp.G * (qe - qs), inp.E)

    def _kv(self, t: Tensor, inp: Inputs, seg: Segment, dtype: torch.dtype) -> Tensor:
        # A key/value shared by the batch is copied per tile here (tile-sized, in the memory model).
        t = t[:, :, seg.ks : seg.ke].reshape(inp.B * inp.Hk, seg.ke - seg.ks, t.shape[-1])
        return t if t.dtype == dtype else t.to(dtype)

    def _raw_scores(self, inp: Inputs, q_t: Tensor, seg: Segment, cdt: torch.dtype) -> Tensor:
        """``scale · q kᵀ`` of one tile, ``(B*Hk, G*qn, kn)`` in the stats dtype."""
        s = torch.bmm(q_t, self._kv(inp.k, inp, seg, cdt).transpose(1, 2))
        return s if s.dtype == inp.stats_dtype else s.to(inp.stats_dtype)

    def _add_bias(self, inp: Inputs, s: Tensor, qs: int, qe: int, seg: Segment) -> Tensor:
        bias = tile_bias(inp, qs, qe, seg, inp.stats_dtype)
        if bias is not None:
            s.view(inp.B, inp.Hq, qe - qs, seg.ke - seg.ks).add_(bias)
        return s

    def _scores(self, inp: Inputs, q_t: Tensor, qs: int, qe: int, seg: Segment, cdt: torch.dtype) -> Tensor:
        s = self._raw_scores(inp, q_t, seg, cdt)
        if inp.score_mod is not None:
            qn, kn = qe - qs, seg.ke - seg.ks
            s = apply_score_mod(inp, s.view(inp.B, inp.Hq, qn, kn), qs, qe, seg.ks, seg.ke)
            s = s.reshape(inp.B * inp.Hk, inp.G * qn, kn)
        return self._add_bias(inp, s, qs, qe, seg)

    def forward_rows(
        self, inp: Inputs, qs: int, qe: int, segments: Iterable[Segment], out: Tensor, seed: int
    ) -> Tensor:
        """Online softmax over ``segments`` for rows ``[qs, qe)``; writes ``out`` and returns the lse."""
        B, Hq, Hk, G = inp.B, inp.Hq, inp.Hk, inp.G
        qn = qe - qs
        sdt = inp.stats_dtype
        cdt = self.compute_dtype(inp)
        q_t = self._scaled_q(inp, qs, qe, cdt)
        state = RowState(
            m=torch.full((B * Hk, G * qn), NEG_INF, dtype=sdt, device=inp.device),
            l=torch.zeros((B * Hk, G * qn), dtype=sdt, device=inp.device),
            acc=torch.zeros((B * Hk, G * qn, inp.Ev), dtype=sdt, device=inp.device),
        )
        for seg in segments:
            s = self._scores(inp, q_t, qs, qe, seg, cdt)
            m_new = torch.maximum(state.m, s.amax(dim=-1))
            m_ref = m_new.masked_fill(m_new == NEG_INF, 0.0)  # rows with nothing visible yet stay finite
            p = s.sub_(m_ref.unsqueeze(-1)).exp_()
            correction = torch.exp(state.m - m_ref)
            state.l.mul_(correction).add_(p.sum(dim=-1))
            state.acc.mul_(correction.unsqueeze(-1))
            if inp.dropout_p > 0.0:
                p.view(B, Hq, qn, -1).mul_(dropout_scale(inp, seed, qs, qe, seg.ks, seg.ke, sdt))
            v_t = self._kv(inp.v, inp, seg, cdt)
            if v_t.dtype == sdt:
                state.acc.baddbmm_(p, v_t)
            else:
                state.acc.add_(torch.bmm(p.to(v_t.dtype), v_t))
            state.m.copy_(m_new)
            del s, p
        l_safe = state.l.masked_fill(state.l == 0, 1.0)  # fully masked rows: acc is 0, so output 0
        out[:, :, qs:qe].copy_(state.acc.div_(l_safe.unsqueeze(-1)).view(B, Hq, qn, inp.Ev))
        return (state.m + torch.log(state.l)).view(B, Hq, qn)

    def backward_rows(
        self,
        inp: Inputs,
        qs: int,
        qe: int,
        segments: Iterable[Segment],
        grad_out: Tensor,
        out: Tensor,
        lse: Tensor,
        seed: int,
        grads: "Grads",
        grad_lse: Optional[Tensor] = None,
    ) -> None:
        """FlashAttention-2 backward for rows ``[qs, qe)``, accumulated into ``grads``.

        ``P = exp(S - lse)``; ``dV += Pᵀ dO``; ``dP = dO Vᵀ``; ``dS = P ∘ (dP - D)`` with
        ``D = rowsum(dO ∘ O) - dlse`` (``∂lse/∂S = P``, so a gradient on the returned lse only
        shifts D); ``dQ += scale·dS K``; ``dK += scale·dSᵀ Q``. ``dS`` is also the gradient of a
        float mask tile and, pulled back through ``score_mod``, of what it captured.
        """
        B, Hq, Hk, G = inp.B, inp.Hq, inp.Hk, inp.G
        qn = qe - qs
        sdt = inp.stats_dtype
        q_t = self._scaled_q(inp, qs, qe, sdt)
        do_t = grad_out[:, :, qs:qe].to(sdt).reshape(B * Hk, G * qn, inp.Ev)
        D = (do_t * out[:, :, qs:qe].reshape(B * Hk, G * qn, inp.Ev).to(sdt)).sum(dim=-1, keepdim=True)
        if grad_lse is not None:
            D -= grad_lse[:, :, qs:qe].reshape(B * Hk, G * qn, 1).to(sdt)
        lse_t = lse[:, :, qs:qe].reshape(B * Hk, G * qn, 1).to(sdt)
        lse_t = lse_t.masked_fill(lse_t == NEG_INF, 0.0)  # fully masked rows: S = -inf, so P = 0
        dq_acc = torch.zeros_like(q_t) if grads.dq is not None else None
        for seg in segments:
            kn = seg.ke - seg.ks
            k_t = self._kv(inp.k, inp, seg, sdt)
            v_t = self._kv(inp.v, inp, seg, sdt)
            s_in: Optional[Tensor] = None
            s_mod: Optional[Tensor] = None
            if inp.score_mod is None:
                s = self._scores(inp, q_t, qs, qe, seg, sdt)
            else:
                raw = torch.bmm(q_t, k_t.transpose(1, 2)).view(B, Hq, qn, kn)
                with torch.enable_grad():
                    s_in = raw.detach().requires_grad_()
                    leaves = _CapturedAsLeaves(grads.proxies, [s_in])
                    s_mod = apply_score_mod(inp, s_in, qs, qe, seg.ks, seg.ke, leaves)
                s = self._add_bias(inp, s_mod.detach().reshape(B * Hk, G * qn, kn).clone(), qs, qe, seg)
            p = s.sub_(lse_t).exp_()
            dp = torch.bmm(do_t, v_t.transpose(1, 2))
            pd = p
            if inp.dropout_p > 0.0:
                z = dropout_scale(inp, seed, qs, qe, seg.ks, seg.ke, sdt).expand(B, Hq, qn, kn).reshape(B * Hk, G * qn, kn)
                pd = p * z
                dp.mul_(z)
                del z
            if grads.dv is not None:
                add_into(grads.dv[:, :, seg.ks : seg.ke], torch.bmm(pd.transpose(1, 2), do_t).view(B, Hk, kn, inp.Ev))
            del pd
            ds = p.mul_(dp.sub_(D))
            del dp
            if grads.dmask is not None:
                target = grads.dmask
                if target.shape[-2] != 1:
                    target = target[..., qs:qe, :]
                if target.shape[-1] != 1:
                    target = target[..., seg.ks : seg.ke]
                add_into(target, ds.view(B, Hq, qn, kn))
            if s_mod is not None and s_in is not None:
                proxies = list(grads.proxies.values())
                pulled = torch.autograd.grad(s_mod, [s_in, *proxies], ds.view(B, Hq, qn, kn), allow_unused=True)
                for acc_g, g in zip(grads.dcaptured, pulled[1:]):
                    if g is not None:
                        acc_g += g
                ds = pulled[0].reshape(B * Hk, G * qn, kn) if pulled[0] is not None else torch.zeros_like(ds)
                del s_mod, s_in, pulled
            if dq_acc is not None:
                dq_acc.baddbmm_(ds, k_t)
            if grads.dk is not None:
                # q_t already carries the scale.
                add_into(grads.dk[:, :, seg.ks : seg.ke], torch.bmm(ds.transpose(1, 2), q_t).view(B, Hk, kn, inp.E))
            del ds
        if grads.dq is not None and dq_acc is not None:
            add_into(grads.dq[:, :, qs:qe], dq_acc.mul_(inp.scale).view(B, Hq, qn, inp.E))


class Grads(NamedTuple):
    """Gradient accumulators of one backward (``None`` where no gradient is wanted).

    ``proxies`` maps each captured tensor (by ``id``) to the detached leaf that stands for it
    inside ``score_mod`` during the backward; ``dcaptured`` accumulates their gradients, in order.
    """

    dq: Optional[Tensor]
    dk: Optional[Tensor]
    dv: Optional[Tensor]
    dmask: Optional[Tensor]
    proxies: Dict[int, Tensor] = {}
    dcaptured: Sequence[Tensor] = ()


# ------------------------------------------------------------------ fused CPU kernel
def _cpu_flash_ops() -> Tuple[Optional[Callable[..., Tuple[Tensor, Tensor]]], Optional[Callable[..., Tuple[Tensor, Tensor, Tensor]]]]:
    ops = torch.ops.aten
    fwd = getattr(ops, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(ops, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    return fwd, bwd


def _probe_cpu_flash() -> Optional[str]:
    """Run the private CPU flash kernel once on a tiny input; ``None`` if it works, else why not."""
    fwd, bwd = _cpu_flash_ops()
    if fwd is None:
        return "this PyTorch build has no aten._scaled_dot_product_flash_attention_for_cpu"
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, 3, 4, generator=g, dtype=torch.float64)
        k = torch.randn(1, 1, 5, 4, generator=g, dtype=torch.float64)
        v = torch.randn(1, 1, 5, 4, generator=g, dtype=torch.float64)
        mask = torch.zeros(3, 5, dtype=torch.float64)
        mask[1, 2:] = NEG_INF
        o, lse = fwd(q, k, v, 0.0, False, attn_mask=mask, scale=0.5)
        s = (q @ k.transpose(-1, -2)) * 0.5 + mask
        ref_lse = torch.logsumexp(s, dim=-1)
        ref = torch.softmax(s, dim=-1) @ v
        if o.shape != ref.shape or lse.shape != ref_lse.shape:
            return "the private CPU flash kernel returned unexpected shapes (GQA or lse layout changed)"
        if not (torch.allclose(o, ref, atol=1e-10) and torch.allclose(lse.to(torch.float64), ref_lse, atol=1e-10)):
            return "the private CPU flash kernel failed its self-check"
        if bwd is None:
            return "this PyTorch build has no aten._scaled_dot_product_flash_attention_for_cpu_backward"
    except Exception as e:  # a changed private signature surfaces as any error
        return f"the private CPU flash kernel failed its self-check ({type(e).__name__}: {e})"
    return None


_CPU_FLASH_PROBE: List[Optional[str]] = []


def cpu_flash_unavailable_reason() -> Optional[str]:
    if not _CPU_FLASH_PROBE:
        _CPU_FLASH_PROBE.append(_probe_cpu_flash())
    return _CPU_FLASH_PROBE[0]


def _as_kernel_mask(bias: Optional[Tensor]) -> Optional[Tensor]:
    """The kernel takes 2-D or 4-D masks (it broadcasts their size-1 dims itself)."""
    if bias is None or bias.dim() in (2, 4):
        return bias
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    return bias


def _unit_stride(t: Tensor) -> Tensor:
    # The fused kernel reads the last dim as contiguous (SDPA checks this before calling it).
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


EMPTY_CHECK_ELEMENTS = 1 << 20
"""Bounds the temporaries of the empty-row check of a diagonal tile (about 2 bytes each)."""


def empty_rows(bias: Tensor, causal_in_kernel: bool, qn: int) -> Tensor:
    """Rows of a tile that see no key, broadcastable to ``(B, Hq, qn)``.

    A fused kernel reports lse = 0 for them, and when it applies the causal mask itself its
    check ignores that part, so the rows are found here from the bias: a row ``i`` of a diagonal
    tile (top-left causal within the tile) is empty when none of its keys ``0..i`` is visible.
    That check runs over blocks of rows, so its temporaries stay small.
    """
    if not causal_in_kernel:
        return bias.amax(dim=-1) == NEG_INF
    if bias.shape[-2] == 1:
        return _first_visible(bias) > torch.arange(qn, device=bias.device)
    per_row = max(1, bias.numel() // bias.shape[-2])
    step = max(1, EMPTY_CHECK_ELEMENTS // per_row)
    parts = []
    for r0 in range(0, qn, step):
        r1 = min(r0 + step, qn)
        rows = bias[..., r0:r1, :r1] if bias.shape[-1] != 1 else bias[..., r0:r1, :]
        parts.append(_first_visible(rows) > torch.arange(r0, r1, device=bias.device))
    return torch.cat(parts, dim=-1)


def _first_visible(bias: Tensor) -> Tensor:
    """Index of the first visible key of each row (int64 max for a row with none)."""
    visible = bias > NEG_INF
    never = torch.iinfo(torch.int64).max
    return torch.where(visible.any(dim=-1), visible.to(torch.uint8).argmax(dim=-1), never)


class FusedCPUKernel:
    """PyTorch's fused CPU flash kernel per segment, merged by log-sum-exp."""

    name = "fused"

    @staticmethod
    def causal_in_kernel(inp: Inputs, seg: Segment) -> bool:
        # The kernel's own causal flag is top-left within the tile (a diagonal tile). With
        # scale <= 0 it returns NaN (it scales the masked -inf scores), so the mask goes into
        # the bias then.
        return seg.causal == "diag" and inp.scale > 0

    def bias(self, inp: Inputs, qs: int, qe: int, seg: Segment) -> Optional[Tensor]:
        """The tile's float bias for the kernel (masks, generated causal part, additive ``score_mod``)."""
        dtype = inp.bias_dtype
        bias = tile_bias(inp, qs, qe, seg, dtype, causal_in_kernel=self.causal_in_kernel(inp, seg))
        if inp.score_mod is not None:
            add = inp.score_mod.additive_bias  # type: ignore[attr-defined]
            b, h, qi, ki = _index_grids(inp, qs, qe, seg.ks, seg.ke)
            extra = call_user(add, b, h, qi, ki).to(dtype)
            bias = extra if bias is None else bias + extra
        return bias

    @staticmethod
    def _may_mask(inp: Inputs, seg: Segment) -> bool:
        # An additive score_mod alone never masks a whole row: no empty-row check then.
        return inp.attn_mask is not None or seg.causal != "none" or seg.mask_mod

    def _segment(self, inp: Inputs, qs: int, qe: int, seg: Segment) -> Tuple[Tensor, Tensor]:
        fwd, _ = _cpu_flash_ops()
        assert fwd is not None
        causal = self.causal_in_kernel(inp, seg)
        bias = self.bias(inp, qs, qe, seg)
        o_t, lse_t = _call_kernel(
            fwd,
            _unit_stride(inp.q[:, :, qs:qe]),
            _unit_stride(inp.k[:, :, seg.ks : seg.ke]),
            _unit_stride(inp.v[:, :, seg.ks : seg.ke]),
            0.0,
            causal,
            attn_mask=_as_kernel_mask(bias),
            scale=inp.scale,
        )
        if bias is not None and self._may_mask(inp, seg):
            empty = empty_rows(bias, causal, qe - qs)
            if bool(empty.any()):
                # Rows without a visible key weigh nothing in the merge, and give output 0.
                lse_t = lse_t.masked_fill(empty, NEG_INF)
                o_t = o_t.masked_fill(empty.unsqueeze(-1), 0.0)
        return o_t, lse_t

    def forward_rows(
        self, inp: Inputs, qs: int, qe: int, segments: Iterable[Segment], out: Optional[Tensor], seed: int
    ) -> Tuple[Tensor, Tensor]:
        """Returns ``(rows_out, lse)``; ``rows_out`` is also written into ``out`` when one is given."""
        sdt = inp.stats_dtype
        first: Optional[Tuple[Tensor, Tensor]] = None
        acc: Optional[Tensor] = None
        lse = torch.empty(0)
        for seg in segments:
            o_t, lse_t = self._segment(inp, qs, qe, seg)
            if first is None:
                first = (o_t, lse_t)
                continue
            if acc is None:
                acc, lse = first[0].to(sdt), first[1].to(sdt)
            # Exact merge of two partial softmaxes over disjoint keys.
            lse_t = lse_t.to(sdt)
            lse_new = torch.logaddexp(lse, lse_t)
            lse_ref = lse_new.masked_fill(lse_new == NEG_INF, 0.0)
            acc.mul_(torch.exp(lse - lse_ref).unsqueeze(-1))
            acc.add_(o_t.to(sdt).mul_(torch.exp(lse_t - lse_ref).unsqueeze(-1)))
            lse = lse_new
        assert first is not None, "forward_rows needs at least one segment"
        rows, lse = (first[0], first[1]) if acc is None else (acc, lse)
        if out is not None:
            out[:, :, qs:qe].copy_(rows)
        return rows, lse

    def backward_rows(
        self,
        inp: Inputs,
        qs: int,
        qe: int,
        segments: Iterable[Segment],
        grad_out: Tensor,
        out: Tensor,
        lse: Tensor,
        seed: int,
        grads: Grads,
        grad_lse: Optional[Tensor] = None,
    ) -> None:
        """The fused CPU backward per segment, fed the *global* out and lse of these rows."""
        if grad_lse is not None:
            raise NotImplementedError("the fused CPU backward cannot take a gradient of the lse; use the matmul kernel")
        for seg in segments:
            gq, gk, gv = self.segment_backward(inp, qs, qe, seg, grad_out, out, lse)
            if grads.dq is not None:
                add_into(grads.dq[:, :, qs:qe], gq)
            if grads.dk is not None:
                add_into(grads.dk[:, :, seg.ks : seg.ke], gk)
            if grads.dv is not None:
                add_into(grads.dv[:, :, seg.ks : seg.ke], gv)

    def segment_backward(
        self, inp: Inputs, qs: int, qe: int, seg: Segment, grad_out: Tensor, out: Tensor, lse: Tensor
    ) -> Tuple[Tensor, Tensor, Tensor]:
        """dQ of rows ``[qs, qe)`` and dK, dV of keys ``[ks, ke)`` from this segment alone (batch ``B``)."""
        _, bwd = _cpu_flash_ops()
        assert bwd is not None
        # The kernel's own convention for fully masked rows is lse = 0 (their P is 0 either way).
        lse_t = lse[:, :, qs:qe]
        lse_t = lse_t.masked_fill(lse_t == NEG_INF, 0.0).to(torch.float64 if inp.dtype == torch.float64 else torch.float32)
        return _call_kernel(
            bwd,
            _unit_stride(grad_out[:, :, qs:qe]),
            _unit_stride(inp.q[:, :, qs:qe]),
            _unit_stride(inp.k[:, :, seg.ks : seg.ke]),
            _unit_stride(inp.v[:, :, seg.ks : seg.ke]),
            _unit_stride(out[:, :, qs:qe]),
            lse_t,
            0.0,
            self.causal_in_kernel(inp, seg),
            attn_mask=_as_kernel_mask(self.bias(inp, qs, qe, seg)),
            scale=inp.scale,
        )
