"""``torch.nn.attention.varlen.varlen_attn`` on CPU and MPS, computed by subquad (opt-in).

torch 2.13's ``varlen_attn`` calls flash kernels that exist for CUDA only: elsewhere it raises
``NotImplementedError: Could not run 'aten::_flash_attention_forward' ... 'CPU' backend``.
:func:`enable` registers subquad as the CPU (and MPS) kernel of torch's three custom operators,
``torch_attn::_varlen_attn``, ``_varlen_attn_out`` and ``_varlen_attn_backward``
(``torch.library.register_kernel``), so unmodified code runs there -- autograd is torch's own
registration on those operators, which calls the backward kernel; ``return_aux`` gives the lse::

    import subquad.integrations.torch_varlen as tv
    tv.enable(memory_budget="1GiB")
    out = torch.nn.attention.varlen.varlen_attn(q, k, v, cu_seq, cu_seq, max_len, max_len,
                                                 window_size=(-1, 0))   # causal, on the CPU

Semantics are torch's: ``(total, H, D)`` packed sequences, causal and ``window_size`` aligned to
each sequence's bottom-right corner, ``seqused_k`` and a paged ``block_table`` (forward only, as
in torch), lse ``(H, total_q)`` float32 (float64 for float64 inputs, which torch's kernels do not
take: the backward then keeps float64 accuracy). :func:`disable` hands the devices back to torch's
kernels.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

import subquad
from subquad import ArgumentError

from .._for_wings import Varlen, backward_grads, prepare

__all__ = ["enable", "disable", "enabled"]

_LOCK = threading.Lock()
_STATE: Dict[str, Any] = {"devices": (), "options": {}, "registered": set()}
OPTIONS = ("memory_budget", "chunk_size", "backend")


def _ops() -> Any:
    try:
        # The module that defines the operators (older torch has none: its stubs neither).
        from torch.nn.attention import varlen  # type: ignore[attr-defined, unused-ignore]
    except ImportError:
        return None
    names = ("_varlen_attn", "_varlen_attn_out", "_varlen_attn_backward")
    defs = [getattr(varlen, n, None) for n in names]
    return None if any(d is None or not hasattr(d, "register_kernel") for d in defs) else dict(zip(names, defs))


def enable(devices: Tuple[str, ...] = ("cpu", "mps"), **attention_options: Any) -> None:
    """Run ``torch.nn.attention.varlen`` on ``devices`` with subquad (``attention_options``:
    ``memory_budget``, ``chunk_size``, ``backend`` for every call).

    Raises:
        RuntimeError: this torch has no ``torch.nn.attention.varlen`` custom operators.
        TypeError: an unknown option.
    """
    unknown = sorted(set(attention_options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"enable() got unexpected option(s) {unknown}; it accepts {', '.join(OPTIONS)}.")
    ops = _ops()
    if ops is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.nn.attention.varlen operators (torch_attn::_varlen_attn) "
            "to run: they come with torch 2.10 or newer."
        )
    kernels = {"_varlen_attn": _forward, "_varlen_attn_out": _forward_out, "_varlen_attn_backward": _backward}
    with _LOCK:
        for device in devices:
            for name, op in ops.items():
                if (name, device) not in _STATE["registered"]:
                    op.register_kernel(device)(_dispatching(kernels[name], op, device))
                    _STATE["registered"].add((name, device))
        _STATE["devices"] = tuple(devices)
        _STATE["options"] = dict(attention_options)


def disable() -> None:
    """Hand ``torch.nn.attention.varlen`` back to torch's kernels (the registrations stay, inert)."""
    with _LOCK:
        _STATE["devices"] = ()
        _STATE["options"] = {}


def enabled() -> Tuple[str, ...]:
    """The devices subquad runs ``varlen_attn`` on now."""
    return tuple(_STATE["devices"])


def _dispatching(kernel: Any, op: Any, device: str) -> Any:
    """``kernel`` while enabled for ``device``; torch's own implementation otherwise."""
    original = op._init_fn

    def run(*args: Any, **kwargs: Any) -> Any:
        if device in _STATE["devices"]:
            return kernel(*args, **kwargs)
        return original(*args, **kwargs)

    return run


def _window(window_size: Optional[List[int]]) -> Optional[Tuple[Optional[int], Optional[int]]]:
    if window_size is None:
        return None
    if len(window_size) != 2:
        raise ValueError(f"window_size must have length 2, got {len(window_size)}")
    left, right = (None if w < 0 else int(w) for w in window_size)
    return None if left is None and right is None else (left, right)


def _keys(
    key: Tensor, value: Tensor, cu_seq_k: Optional[Tensor], seqused_k: Optional[Tensor], block_table: Optional[Tensor]
) -> Tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """``(key, value, cu_seqlens_k, seqused_k)`` packed: a paged pool is gathered sequence by sequence."""
    if block_table is None:
        if cu_seq_k is None:
            raise ArgumentError("cu_seq_k is None: without a block_table the keys need their offsets.")
        return key, value, cu_seq_k, seqused_k
    if seqused_k is None:
        raise ArgumentError("block_table requires seqused_k (the valid tokens of each sequence), as in torch.")
    page = key.shape[1]
    used = [int(n) for n in seqused_k.tolist()]
    index = (
        torch.cat(
            [
                (
                    block_table[s, : -(-n // page)].to(torch.int64).view(-1, 1) * page
                    + torch.arange(page, device=key.device)
                ).view(-1)[:n]
                for s, n in enumerate(used)
            ]
        )
        if used
        else torch.zeros(0, dtype=torch.int64, device=key.device)
    )
    flat_k, flat_v = key.reshape(-1, *key.shape[2:]), value.reshape(-1, *value.shape[2:])
    cu = torch.tensor([0, *torch.tensor(used).cumsum(0).tolist()] if used else [0], dtype=torch.int32)
    return flat_k.index_select(0, index), flat_v.index_select(0, index), cu, None


def _forward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seq_q: Tensor,
    cu_seq_k: Optional[Tensor],
    max_q: int,
    max_k: int,
    is_causal: bool = False,
    scale: Optional[float] = None,
    window_size: Optional[List[int]] = None,
    enable_gqa: bool = False,
    seqused_k: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    num_splits: Optional[int] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    key, value, cu_k, used = _keys(key, value, cu_seq_k, seqused_k, block_table)
    with torch.no_grad():
        out, lse = subquad.varlen_attention(
            query,
            key,
            value,
            cu_seq_q,
            cu_k,
            seqused_k=used,
            is_causal=is_causal,
            alignment="bottom_right",
            window=_window(window_size),
            scale=scale,
            enable_gqa=enable_gqa,
            return_lse=True,
            **_STATE["options"],
        )
    rng_state = torch.zeros((2,), dtype=torch.uint64, device=query.device)
    return out.contiguous(), lse.t().contiguous(), rng_state


def _forward_out(
    out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seq_q: Tensor,
    cu_seq_k: Optional[Tensor],
    max_q: int,
    max_k: int,
    is_causal: bool = False,
    scale: Optional[float] = None,
    window_size: Optional[List[int]] = None,
    enable_gqa: bool = False,
    seqused_k: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None,
    num_splits: Optional[int] = None,
) -> Tensor:
    result, lse, _ = _forward(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        is_causal,
        scale,
        window_size,
        enable_gqa,
        seqused_k,
        block_table,
        num_splits,
    )
    out.copy_(result)
    return lse


def _backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seq_q: Tensor,
    cu_seq_k: Tensor,
    max_q: int,
    max_k: int,
    is_causal: bool,
    rng_state: Tensor,
    scale: Optional[float] = None,
    window_size: Optional[List[int]] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    # subquad's chunked backward (FlashAttention-2 from the saved out and lse), planned for this call.
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (query, key, value))
        call = prepare(
            q,
            k,
            v,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
            return_lse=True,
            varlen=Varlen(cu_seq_q, cu_seq_k, alignment="bottom_right", window=_window(window_size)),
            **_STATE["options"],
        )
    plan = call.plan
    tiles = plan.backward_chunk_size or plan.chunk_size or (max(call.inp.Lq, 1), max(call.inp.Lk, 1))

    def engine(t: Tensor) -> Tensor:  # (total, H, D) -> the engine's (1, H, total, D), a view
        return t.transpose(0, 1).unsqueeze(0)

    with torch.no_grad():
        dq, dk, dv, _, _ = backward_grads(
            call.inp,
            plan.backward_backend or plan.backend,
            tiles,
            0,
            call.budget,
            engine(grad_out),
            engine(out),
            lse.unsqueeze(0),
            None,
            wanted=(True, True, True, False),
        )
    assert dq is not None and dk is not None and dv is not None
    return tuple(g.squeeze(0).transpose(0, 1).contiguous() for g in (dq, dk, dv))  # type: ignore[return-value]
