"""diffusers integration: an attention processor for diffusers' ``Attention`` modules.

::

    import subquad.integrations.diffusers as sqd

    pipe = StableDiffusionPipeline.from_pretrained(...)
    changed = sqd.enable(pipe, memory_budget="1GiB")   # {"unet.down_blocks.0...attn1": old processor, ...}
    image = pipe(prompt, height=1024, width=1024).images[0]

diffusers is imported only when a model is enabled (``pip install subquad[diffusers]``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

import subquad

from .patch import check_options

__all__ = ["SubquadAttnProcessor", "enable"]

OPTIONS = ("memory_budget", "chunk_size", "backend", "score_mod", "mask_mod")

# diffusers processors that compute exactly what SubquadAttnProcessor computes: plain (self or
# cross) attention over to_q/to_k/to_v with the optional spatial/group/cross/qk norms, residual
# and rescale. Processors that add key/value projections (AddedKV), fuse projections, carry
# weights (IP-Adapter, custom diffusion) or belong to other architectures are left alone.
_REPLACEABLE = frozenset(
    {
        "AttnProcessor",
        "AttnProcessor2_0",
        "AttnProcessorNPU",
        "SlicedAttnProcessor",
        "XFormersAttnProcessor",
        "SubquadAttnProcessor",
    }
)


def _import_attention_class() -> Any:  # diffusers' Attention class
    try:
        from diffusers.models.attention_processor import Attention
    except ImportError as e:  # pragma: no cover - exercised only without diffusers
        raise ImportError("subquad.integrations.diffusers needs diffusers: pip install 'subquad[diffusers]'") from e
    return Attention


class SubquadAttnProcessor:
    """Drop-in replacement for diffusers' ``AttnProcessor2_0`` that runs ``subquad.sdpa``.

    ::

        unet.set_attn_processor(SubquadAttnProcessor(memory_budget="512MiB"))

    It does what diffusers' default processor does, in the same order: spatial norm, flattening
    of ``(B, C, H, W)`` feature maps to tokens, group norm, cross-attention norm, q/k norms,
    output projection and dropout, residual connection and ``rescale_output_factor``; so self-
    and cross-attention in UNets and the VAE's mid-block attention give the same outputs.
    Differences, all in the direction of doing less work or being more exact:

    - the softmax scale is ``attn.scale`` (diffusers' default processor leaves SDPA's default
      ``1/sqrt(head_dim)``, which equals ``attn.scale`` unless ``scale_qk=False``);
    - an attention mask as diffusers passes it (a bias or bool of shape ``(B, 1, Lk)``,
      ``(B, Lq, Lk)``, or already per head ``(B*heads, Lq, Lk)``) is broadcast over the heads
      instead of being repeated per head;
    - ``upcast_attention``/``upcast_softmax`` need nothing: subquad keeps the softmax
      statistics in float32 for half-precision inputs.

    Args:
        **attention_options: keyword options of ``subquad.attention`` for every call:
            ``memory_budget``, ``chunk_size``, ``backend``, ``score_mod``, ``mask_mod``.

    Raises:
        TypeError: an unknown option.
    """

    def __init__(self, **attention_options: Any) -> None:
        self.options = check_options(attention_options, OPTIONS, "SubquadAttnProcessor")

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"SubquadAttnProcessor({inner})"

    def __call__(
        self,
        attn: Any,
        hidden_states: Tensor,
        encoder_hidden_states: Optional[Tensor] = None,
        attention_mask: Optional[Tensor] = None,
        temb: Optional[Tensor] = None,
        *args: Any,
        **kwargs: Any,
    ) -> Tensor:
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)

        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)

        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        batch_size, sequence_length, _ = context.shape

        if attention_mask is not None:
            attention_mask = _heads_mask(attn, attention_mask, sequence_length, batch_size)

        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        head_dim = key.shape[-1] // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        # Like diffusers' own processor: no attention dropout, never causal.
        hidden_states = subquad.sdpa(query, key, value, attn_mask=attention_mask, scale=attn.scale, **self.options)

        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)

        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        out: Tensor = hidden_states / attn.rescale_output_factor
        return out


def _heads_mask(attn: Any, mask: Tensor, key_length: int, batch_size: int) -> Tensor:
    """diffusers' mask, shaped to broadcast against ``(B, heads, Lq, Lk)`` scores.

    ``Attention.prepare_attention_mask`` repeats a per-sample mask for every head; a view that
    broadcasts is equal and costs nothing. A mask whose length differs from the keys goes through
    diffusers' own preparation, so that its (padding) behaviour is reproduced exactly.
    """
    if mask.shape[-1] != key_length:
        mask = attn.prepare_attention_mask(mask, key_length, batch_size)
        return mask.view(batch_size, attn.heads, -1, mask.shape[-1])
    if mask.shape[0] < batch_size * attn.heads:
        return mask.reshape(mask.shape[0], 1, -1, mask.shape[-1])
    return mask.view(batch_size, attn.heads, -1, mask.shape[-1])


def _models(model_or_pipeline: Any) -> List[Tuple[str, torch.nn.Module]]:
    if isinstance(model_or_pipeline, torch.nn.Module):
        return [("", model_or_pipeline)]
    components = getattr(model_or_pipeline, "components", None)
    if isinstance(components, dict):
        return [
            (f"{name}.", component) for name, component in components.items() if isinstance(component, torch.nn.Module)
        ]
    raise TypeError(
        "enable() expects a torch.nn.Module (a diffusers model) or a diffusers pipeline (an object "
        f"with a .components dict), got {type(model_or_pipeline).__name__}."
    )


def _replaceable(module: torch.nn.Module, attention_class: type) -> bool:
    if not isinstance(module, attention_class):
        return False
    processor = getattr(module, "processor", None)
    return (
        type(processor).__name__ in _REPLACEABLE
        and getattr(module, "added_kv_proj_dim", None) is None
        and not getattr(module, "fused_projections", False)
        and getattr(module, "to_k", None) is not None
        and getattr(module, "to_out", None) is not None
    )


def enable(model_or_pipeline: Any, **attention_options: Any) -> Dict[str, Any]:
    """Install :class:`SubquadAttnProcessor` on every attention module it can replace.

    ::

        changed = enable(pipe, memory_budget="1GiB")            # every model of a pipeline
        changed = enable(pipe.unet, chunk_size=(1024, 4096))    # or one model
        for name, old in changed.items():                       # undo
            pipe.unet.get_submodule(name.removeprefix("unet.")).set_processor(old)

    A module is replaced when it is a diffusers ``Attention`` whose processor is one that
    computes plain attention (``AttnProcessor``, ``AttnProcessor2_0``, sliced, xFormers, NPU,
    or a previous ``SubquadAttnProcessor``). Processors with extra key/value projections, fused
    projections, trained weights (IP-Adapter, custom diffusion) or another layout are kept;
    models of a pipeline that are not diffusers models (the text encoder) are left alone: use
    ``subquad.integrations.transformers`` for those.

    Args:
        model_or_pipeline: a diffusers model (``torch.nn.Module``) or pipeline.
        **attention_options: passed to :class:`SubquadAttnProcessor`.

    Returns:
        ``{qualified module name: previous processor}`` for every module changed; pipeline
        components are prefixed with their name (``"unet."``, ``"vae."``).

    Raises:
        TypeError: an unknown option, or an object that is neither a module nor a pipeline.
        ImportError: diffusers is not installed.
    """
    processor = SubquadAttnProcessor(**attention_options)
    attention_class = _import_attention_class()
    changed: Dict[str, Any] = {}
    for prefix, model in _models(model_or_pipeline):
        for name, module in model.named_modules():
            if _replaceable(module, attention_class):
                changed[prefix + name] = module.processor
                module.set_processor(processor)
    return changed
