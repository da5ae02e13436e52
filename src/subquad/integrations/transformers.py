"""transformers integration: an attention implementation named ``"subquad"``.

::

    import subquad.integrations.transformers as sqt

    sqt.register(memory_budget="2GiB")
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="subquad")
    # or, on a loaded model:
    model.set_attn_implementation("subquad")

transformers is imported only by :func:`register` (``pip install subquad[transformers]``).

Two functions are registered under the name. The attention function mirrors transformers' own
``"sdpa"`` one (same arguments, same ``(B, Lq, H, Ev)`` output), with grouped-query attention
left to subquad instead of repeating key/value heads. The mask function replaces the
``(B, 1, Lq, Lk)`` boolean mask that ``"sdpa"`` builds (``Lq·Lk`` bytes per sequence, 4 GiB at
65,536 tokens) by a :class:`LazyMask`: transformers' own mask function (causal, sliding window,
chunked, padding, packed sequences), which subquad evaluates per tile as a ``mask_mod``.
Where ``"sdpa"`` would pass no mask and rely on ``is_causal``, so does ``"subquad"``. Padding-free
batches that carry flash-attn's ``cu_seq_lens_q``/``cu_seq_lens_k`` (transformers'
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``) run through
``subquad.varlen_attention`` instead, one sequence per tile group, with no mask at all.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

import subquad

from .patch import check_options

__all__ = ["register", "LazyMask", "NAME"]

NAME = "subquad"
"""The name :func:`register` gives the attention and mask functions: ``attn_implementation="subquad"``."""
OPTIONS = ("memory_budget", "chunk_size", "backend")

_options: Dict[str, Any] = {}

_logger: Any = logging.getLogger("transformers.integrations.subquad")
"""A child of transformers' logger, as ``"sdpa"``'s is, so that transformers' verbosity settings apply to
its warnings too; ``warning_once`` is the method transformers adds to ``logging.Logger``."""


class LazyMask:
    """A transformers attention mask kept as a function of positions, never materialized.

    ``mask_mod(b, h, q_idx, kv_idx) -> bool`` takes the positions *within* the attention call
    (0-based rows and key columns); the cache offsets are already applied. ``shape`` is the
    ``(B, 1, Lq, Lk)`` of the tensor it stands for, for code that inspects masks. ``padding``:
    the 2-D padding mask (True = a real token) folded into it, or None.
    """

    def __init__(
        self,
        mask_mod: Callable[..., Tensor],
        shape: Tuple[int, int, int, int],
        device: Any,
        padding: Optional[Tensor] = None,
    ) -> None:
        self.mask_mod = mask_mod
        self.shape = torch.Size(shape)
        self.device = torch.device(device)
        self.dtype = torch.bool
        self.padding = padding

    @property
    def ndim(self) -> int:
        return 4

    def dim(self) -> int:
        return 4

    def contiguous(self) -> LazyMask:
        # generate() calls it on the mask it builds ahead for compileable caches (transformers 5.20)
        return self

    def __repr__(self) -> str:
        return f"LazyMask(shape={tuple(self.shape)})"

    def materialize(self) -> Tensor:
        """The equivalent boolean tensor ``(B, 1, Lq, Lk)``, True = attend (for tests and debugging)."""
        B, _, Lq, Lk = self.shape
        b = torch.arange(B, device=self.device).view(B, 1, 1, 1)
        h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=self.device)
        q = torch.arange(Lq, device=self.device).view(1, 1, Lq, 1)
        k = torch.arange(Lk, device=self.device).view(1, 1, 1, Lk)
        return torch.as_tensor(self.mask_mod(b, h, q, k), device=self.device).expand(B, 1, Lq, Lk)


def _all_true(mask: Tensor) -> bool:
    return bool(mask.all())


def _pad_keys(padding_mask: Optional[Tensor], total: int) -> Optional[Tensor]:
    # A static cache is longer than the 2-D mask the user passed; the extra slots are empty.
    if padding_mask is not None and padding_mask.shape[-1] < total:
        padding_mask = torch.nn.functional.pad(padding_mask, (0, total - padding_mask.shape[-1]), value=False)
    return padding_mask


_masking_utils: Any = None
"""``transformers.masking_utils``, kept by :func:`register`: a compiled model reads it as a global,
where torch 2.9's dynamo cannot trace ``from transformers import masking_utils`` (transformers is a
``_LazyModule``: "Bad import result")."""


def _mu() -> Any:
    global _masking_utils
    if _masking_utils is None:
        from transformers import masking_utils

        _masking_utils = masking_utils
    return _masking_utils


def subquad_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    mask_function: Optional[Callable[..., Tensor]] = None,
    attention_mask: Optional[Tensor] = None,
    local_size: Optional[int] = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    device: Any = "cpu",
    **kwargs: Any,
) -> Any:
    """transformers' mask interface for ``"subquad"``: ``None`` where ``"sdpa"`` skips the mask, else a LazyMask.

    Same arguments as ``transformers.masking_utils.sdpa_mask``. ``None`` means: no padding and a
    pattern that ``is_causal`` (or no mask) expresses; the attention function then reads the
    module's ``is_causal``, as the ``"sdpa"`` one does.
    """
    mu = _mu()
    if isinstance(attention_mask, LazyMask):
        # Built ahead by generate() for this very step (compileable caches) and handed back
        # to the model, which asks again: it is already the final mask.
        return attention_mask
    tracing = torch.compiler.is_compiling() or torch.jit.is_tracing()
    if use_vmap or tracing:
        # A custom pattern that need not be index-based (transformers vmaps it), or a graph being
        # compiled (the subquad::attention operator takes tensors, not callables): build the
        # tensor the way "sdpa" does.
        return mu.sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function or mu.causal_mask_function,
            attention_mask=attention_mask,
            local_size=local_size,
            allow_is_causal_skip=allow_is_causal_skip,
            allow_is_bidirectional_skip=allow_is_bidirectional_skip,
            use_vmap=use_vmap,
            device=device,
            **kwargs,
        )
    if mask_function is None:
        mask_function = mu.causal_mask_function

    padding_mask = _pad_keys(attention_mask, kv_length + int(kv_offset))
    skips = allow_is_causal_skip, allow_is_bidirectional_skip
    if _sdpa_skips_mask(padding_mask, q_length, kv_length, q_offset, kv_offset, local_size, skips):
        return None

    # "sdpa" evaluates its mask here; this one is evaluated inside each layer, after the layer has
    # written its keys to the cache. So it keeps copies of the tensors the caller may change in
    # place meanwhile: a StaticCache's query offset is its cumulative_length, which each layer's
    # update() increases (read live, every query would also see the next, still empty slot). A
    # clone of the 0-d tensor rather than int(): no device sync on the decode step. The 2-D mask
    # is copied only where it is still the caller's own tensor (B x Lk bools).
    if isinstance(q_offset, Tensor):
        q_offset = q_offset.clone()
    pad = padding_mask.clone() if padding_mask is not None and padding_mask is attention_mask else padding_mask

    # Positions inside the call -> absolute positions, which transformers' functions expect.
    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q, k = q_idx + q_offset, kv_idx + kv_offset
        keep = mask_function(b, h, q, k)
        return keep if pad is None else keep & pad[b, k]

    return LazyMask(mask_mod, (batch_size, 1, q_length, kv_length), device, padding=pad)


def _sdpa_skips_mask(
    padding_mask: Optional[Tensor],
    q_length: int,
    kv_length: int,
    q_offset: Any,
    kv_offset: Any,
    local_size: Optional[int],
    skips: Tuple[bool, bool],
) -> bool:
    """Whether transformers' ``"sdpa"`` passes no mask here (``skips``: whether it may skip a causal
    mask, a bidirectional one): the pattern is what ``is_causal``, or no mask, expresses."""
    allow_is_causal_skip, allow_is_bidirectional_skip = skips
    window_applies = local_size is not None and kv_length >= local_size
    if window_applies or isinstance(q_offset, Tensor):
        return False
    no_padding = padding_mask is None or _all_true(padding_mask[:, kv_offset : kv_offset + kv_length])
    if allow_is_causal_skip:
        # Same rules as transformers' "sdpa": a square causal block or one query row is what
        # is_causal expresses; so is an empty static cache whose extra slots are padding.
        if no_padding and (q_length == 1 or q_length == kv_length):
            return True
        if (
            q_offset == 0
            and kv_offset == 0
            and (
                padding_mask is None
                or (_all_true(padding_mask[:, :q_length]) and not bool(padding_mask[:, q_length:kv_length].any()))
            )
        ):
            return True
    return allow_is_bidirectional_skip and no_padding


def _softcap_mod(softcap: float) -> Callable[..., Tensor]:
    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return softcap * torch.tanh(score / softcap)

    return score_mod


def _causal_mod(offset: int) -> Callable[..., Tensor]:
    # Bottom-right aligned when the keys outnumber the queries (a cache before the block).
    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx <= q_idx + offset

    return mask_mod


def _packed_offsets(attention_mask: Any, position_bias: Optional[Tensor], kwargs: Dict[str, Any]) -> Any:
    """``(cu_seq_lens_q, cu_seq_lens_k)`` when the call is a padding-free batch subquad can run packed, else None.

    transformers passes flash-attn's kwargs through (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``):
    ``cu_seq_lens_q``/``cu_seq_lens_k`` offsets into the batch flattened to one row, ``max_length_q``/
    ``max_length_k``. The mask the model built from the packed ``position_ids`` says the same
    (causal within each sequence) and is then not needed, unless it also carries padding.
    """
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None or cu_k is None or position_bias is not None or torch.compiler.is_compiling():
        return None
    if isinstance(attention_mask, LazyMask):
        if attention_mask.padding is not None and not _all_true(attention_mask.padding):
            return None
    elif attention_mask is not None:
        return None  # a tensor mask (a custom one): it is the model's word
    return cu_q, cu_k


def _packed_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    offsets: Tuple[Tensor, Tensor],
    *,
    causal: bool,
    dropout: float,
    scaling: Optional[float],
    softcap: Optional[float],
    s_aux: Optional[Tensor],
    kwargs: Dict[str, Any],
) -> Tensor:
    """flash-attn's varlen path through ``subquad.varlen_attention``: ``(B, Lq, Hq, Ev)``.

    As transformers' flash path: the batch flattened to ``(B*L, H, E)`` rows, causal with
    flash-attn's bottom-right alignment, ``sliding_window`` as the window ``(w - 1, w - 1)``.
    """
    B, Hq, Lq, _ = query.shape
    q, k, v = (t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in (query, key, value))
    lengths: Dict[str, Any] = {}
    for name, given in (("max_seqlen_q", kwargs.get("max_length_q")), ("max_seqlen_k", kwargs.get("max_length_k"))):
        if given is not None:
            lengths[name] = int(given)
    sliding_window = kwargs.get("sliding_window")
    window = None if sliding_window is None else (int(sliding_window) - 1, int(sliding_window) - 1)
    result = subquad.varlen_attention(
        q,
        k,
        v,
        offsets[0].to(torch.int32),
        offsets[1].to(torch.int32),
        **lengths,
        is_causal=causal,
        alignment="bottom_right",
        window=window,
        score_mod=None if softcap is None else _softcap_mod(float(softcap)),
        scale=scaling,
        enable_gqa=Hq != key.shape[1],
        dropout_p=dropout,
        return_lse=s_aux is not None,
        **_options,
    )
    out, lse = result if isinstance(result, tuple) else (result, None)  # (B*Lq, Hq, Ev), (B*Lq, Hq)
    if s_aux is not None and lse is not None:
        out = out * torch.sigmoid(lse - s_aux.to(lse.dtype).view(1, -1)).unsqueeze(-1).to(out.dtype)
    return out.reshape(B, Lq, Hq, out.shape[-1])


def _masks(
    attention_mask: Any, position_bias: Optional[Tensor], causal: bool, q_length: int, key: Tensor, value: Tensor
) -> Tuple[Optional[Tensor], Optional[Callable[..., Tensor]], bool, Tensor, Tensor]:
    """The model's mask and position bias as subquad's ``(attn_mask, mask_mod, is_causal)``, with
    the keys and values (cut to the queries where a prefill fills an empty static cache)."""
    attn_mask: Optional[Tensor] = None
    mask_mod = None
    kv_length = key.shape[2]
    if isinstance(attention_mask, LazyMask) and torch.compiler.is_compiling():
        # Built outside the compiled region (e.g. by generate()); the operator needs a tensor.
        attention_mask = attention_mask.materialize()
    if isinstance(attention_mask, LazyMask):
        mask_mod = attention_mask.mask_mod
        causal = False
    elif attention_mask is not None:
        attn_mask = attention_mask
        causal = False
    else:
        causal = causal and q_length > 1
        if causal and kv_length > q_length:
            # Prefill into an empty static cache: the slots past the queries are empty.
            key, value = key[:, :, :q_length], value[:, :, :q_length]
            if position_bias is not None:
                position_bias = position_bias[..., :q_length]
    if position_bias is not None:
        if attn_mask is None:
            attn_mask = position_bias
        elif attn_mask.dtype == torch.bool:
            attn_mask = position_bias.masked_fill(~attn_mask, float("-inf"))
        else:
            attn_mask = position_bias + attn_mask
        if causal:
            mask_mod, causal = _causal_mod(0), False
    return attn_mask, mask_mod, causal, key, value


def subquad_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    position_bias: Optional[Tensor] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[Tensor] = None,
    **kwargs: Any,
) -> Tuple[Tensor, None]:
    """transformers' attention interface for ``"subquad"``.

    ``query (B, Hq, Lq, E)``, ``key (B, Hk, Lk, E)``, ``value (B, Hk, Lk, Ev)`` with ``Hq`` a
    multiple of ``Hk``; ``attention_mask`` is ``None``, a :class:`LazyMask`, or a bool/float
    tensor that broadcasts to ``(B, Hq, Lq, Lk)`` (a custom 4-D mask is passed through).
    Returns ``(out (B, Lq, Hq, Ev), None)``: attention weights are never formed. With
    ``output_attentions=True`` it does what ``"sdpa"`` does: logs a warning once (through
    transformers' logging) and returns no weights.

    Beyond ``"sdpa"``: ``softcap`` (Gemma 2) runs as a ``score_mod``, and attention sinks
    (``s_aux``, one logit per head) renormalise the output by the log-sum-exp.

    Padding-free batches: given flash-attn's ``cu_seq_lens_q``/``cu_seq_lens_k`` (and
    ``max_length_q``/``max_length_k``), as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
    produces them, the call runs through :func:`subquad.varlen_attention`, each sequence in its own
    tiles (causal bottom-right aligned and ``sliding_window`` as flash-attn's path has them), and no
    mask is evaluated; not under ``torch.compile``, with a position bias or a padding mask.
    """
    if kwargs.get("output_attentions", False):
        # As "sdpa" does: say so once and return no weights (the model's outputs then hold empty
        # tuples of attentions, as under "sdpa").
        _logger.warning_once(
            "`subquad` attention does not support `output_attentions=True`: it never forms the attention weights."
            " Please set your attention to `eager` if you want any of these features."
        )
    q_length = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    offsets = _packed_offsets(attention_mask, position_bias, kwargs)
    if offsets is not None:
        out = _packed_attention(
            query,
            key,
            value,
            offsets,
            causal=bool(causal),
            dropout=dropout,
            scaling=scaling,
            softcap=softcap,
            s_aux=s_aux,
            kwargs=kwargs,
        )
        return out, None

    attn_mask, mask_mod, causal, key, value = _masks(attention_mask, position_bias, bool(causal), q_length, key, value)
    score_mod = None
    if softcap is not None:
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            raise NotImplementedError(
                'attn_implementation="subquad" does not combine softcap with a float mask or position bias; '
                'use attn_implementation="eager".'
            )
        score_mod = _softcap_mod(float(softcap))

    result = subquad.attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        is_causal=causal,
        mask_mod=mask_mod,
        score_mod=score_mod,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
        dropout_p=dropout,
        return_lse=s_aux is not None,
        **_options,
    )
    out, lse = result if isinstance(result, tuple) else (result, None)
    if s_aux is not None and lse is not None:
        # softmax over the keys plus one sink logit per head: the key part is scaled by
        # exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink); rows with no key give 0. The
        # lse is differentiable, so the sinks and q/k train through this.
        sink = s_aux.to(lse.dtype).view(1, -1, 1)
        out = out * torch.sigmoid(lse - sink).unsqueeze(-1).to(out.dtype)
    return out.transpose(1, 2).contiguous(), None


def register(**attention_options: Any) -> None:
    """Register ``"subquad"`` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.

    ::

        subquad.integrations.transformers.register(memory_budget="1GiB")
        model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="subquad")

    Call it before loading (or ``set_attn_implementation("subquad")``). Calling it again replaces
    the options for every model that uses ``"subquad"``. Works with the models that route their
    attention through ``AttentionInterface`` (those that accept ``attn_implementation="sdpa"``
    in the functional style), including grouped-query attention, left padding, sliding-window
    and chunked layers and cached generation.

    Args:
        **attention_options: ``memory_budget``, ``chunk_size``, ``backend`` of ``subquad.attention``
            for every call. (Masks and scores come from the model.)

    Raises:
        TypeError: an unknown option.
        ImportError: transformers is not installed.
    """
    options = check_options(attention_options, OPTIONS, "register")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:  # pragma: no cover - exercised only without transformers
        raise ImportError(
            "subquad.integrations.transformers needs transformers: pip install 'subquad[transformers]'"
        ) from e
    _mu()
    _options.clear()
    _options.update(options)
    AttentionInterface.register(NAME, subquad_attention_forward)
    AttentionMaskInterface.register(NAME, subquad_mask)
