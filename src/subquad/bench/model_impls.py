"""The attention implementations ``subquad bench --model`` puts into a whole model.

diffusers models (UNet, VAE) get a processor on every ``Attention`` module:

| name | processor |
|---|---|
| ``classic`` | ``AttnProcessor``: ``baddbmm`` + softmax, the scores exist whole |
| ``sdpa`` | ``AttnProcessor2_0``, diffusers' default (``F.scaled_dot_product_attention``) |
| ``sliced`` | ``set_attention_slice("auto")`` (half the heads at a time); the VAE's single head: ``SlicedAttnProcessor(1)`` |
| ``xformers`` | ``XFormersAttnProcessor``, where xformers has an operator for the device |
| ``subquad`` | ``subquad.integrations.diffusers.SubquadAttnProcessor`` (``--budget``) |

transformers models get an ``attn_implementation``: ``eager``, ``sdpa``, ``flex_attention``,
``subquad`` (``subquad.integrations.transformers.register``). Every implementation is applied
to the same model object, so switching costs nothing and the weights are identical.

What the rest of the package uses: ``ModelImpl``, ``IMPLS``, ``impls_for``, ``REFERENCE``.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from subquad.integrations import diffusers as sq_diffusers
from subquad.integrations import transformers as sq_transformers

from .models import ModelSpec

REFERENCE = "sdpa"  # outputs are compared with this implementation's


@dataclass(frozen=True)
class ModelImpl:
    name: str
    library: str  # "diffusers" or "transformers"
    description: str
    apply: Callable[[torch.nn.Module, Optional[str]], None]  # (model, budget)
    reasons: Optional[Callable[[ModelSpec, str, str], list[str]]] = None  # (spec, device, mode)

    def not_supported_reasons(self, spec: ModelSpec, device: str, mode: str) -> list[str]:
        return self.reasons(spec, device, mode) if self.reasons is not None else []


# ---------------------------------------------------------------------------- diffusers


def _attention_modules(model: torch.nn.Module) -> list:
    from diffusers.models.attention_processor import Attention  # optional dependency (subquad[diffusers])

    return [m for m in model.modules() if isinstance(m, Attention)]


def _processor(factory: Callable[[object], object]) -> Callable[[torch.nn.Module, Optional[str]], None]:
    def apply(model: torch.nn.Module, budget: Optional[str]) -> None:
        for module in _attention_modules(model):
            module.set_processor(factory(module))

    return apply


def _classic(module):
    from diffusers.models.attention_processor import AttnProcessor  # optional dependency

    return AttnProcessor()


def _sdpa(module):
    from diffusers.models.attention_processor import AttnProcessor2_0  # optional dependency

    return AttnProcessor2_0()


def _xformers(module):
    from diffusers.models.attention_processor import XFormersAttnProcessor  # optional dependency

    return XFormersAttnProcessor()


def _sliced(model: Any, budget: Optional[str]) -> None:
    if hasattr(model, "set_attention_slice"):
        model.set_attention_slice("auto")  # what pipe.enable_attention_slicing() does
        return
    from diffusers.models.attention_processor import SlicedAttnProcessor  # optional dependency

    for module in _attention_modules(model):
        module.set_processor(SlicedAttnProcessor(max(1, module.sliceable_head_dim // 2)))


def _subquad_diffusers(model: torch.nn.Module, budget: Optional[str]) -> None:
    options = {} if budget is None else {"memory_budget": budget}
    processor = sq_diffusers.SubquadAttnProcessor(**options)
    for module in _attention_modules(model):
        module.set_processor(processor)


_XFORMERS_CHECKED: dict = {}


def _xformers_reasons(spec: ModelSpec, device: str, mode: str) -> list[str]:
    """xformers counts only where it has an operator for this device: asked with a tiny call."""
    if device not in _XFORMERS_CHECKED:
        try:
            import xformers.ops as xops  # optional dependency (pip install xformers)

            q = torch.zeros(1, 8, 1, 8, device=device)
            xops.memory_efficient_attention(q, q, q)
            _XFORMERS_CHECKED[device] = []
        except ImportError:
            _XFORMERS_CHECKED[device] = ["xformers is not installed (pip install xformers)"]
        except Exception as exc:  # any refusal means no operator here
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            _XFORMERS_CHECKED[device] = [f"xformers has no operator on {device}: {first}"]
    return list(_XFORMERS_CHECKED[device])


# ------------------------------------------------------------------------- transformers


def _attn_implementation(name: str) -> Callable[[torch.nn.Module, Optional[str]], None]:
    def apply(model: Any, budget: Optional[str]) -> None:
        if name == "subquad":
            sq_transformers.register(**({} if budget is None else {"memory_budget": budget}))
        model.set_attn_implementation(name)

    return apply


def _flex_reasons(spec: ModelSpec, device: str, mode: str) -> list[str]:
    if mode == "train" and torch.device(device).type == "cpu":
        return ["FlexAttention has no backward on CPU"]
    return []


# ----------------------------------------------------------------------------- registry

IMPLS: dict[str, ModelImpl] = {
    impl.name: impl
    for impl in (
        ModelImpl(
            "classic", "diffusers", "diffusers AttnProcessor (baddbmm + softmax, scores whole)", _processor(_classic)
        ),
        ModelImpl(
            "sdpa", "diffusers", "diffusers AttnProcessor2_0 (F.scaled_dot_product_attention)", _processor(_sdpa)
        ),
        ModelImpl(
            "sliced",
            "diffusers",
            "sliced attention: set_attention_slice('auto'), "
            "SlicedAttnProcessor(max(1, heads // 2)) where the model has no such method",
            _sliced,
        ),
        ModelImpl("xformers", "diffusers", "diffusers XFormersAttnProcessor", _processor(_xformers), _xformers_reasons),
        ModelImpl("subquad", "diffusers", "subquad.integrations.diffusers.SubquadAttnProcessor", _subquad_diffusers),
    )
}
TRANSFORMERS_IMPLS: dict[str, ModelImpl] = {
    impl.name: impl
    for impl in (
        ModelImpl(
            "eager", "transformers", "transformers eager attention (matmul + softmax)", _attn_implementation("eager")
        ),
        ModelImpl(
            "sdpa", "transformers", "transformers sdpa (F.scaled_dot_product_attention)", _attn_implementation("sdpa")
        ),
        ModelImpl(
            "flex_attention",
            "transformers",
            "transformers flex_attention (compiled FlexAttention)",
            _attn_implementation("flex_attention"),
            _flex_reasons,
        ),
        ModelImpl(
            "subquad",
            "transformers",
            "subquad.integrations.transformers (attn_implementation='subquad')",
            _attn_implementation("subquad"),
        ),
    )
}


def impls_for(spec: ModelSpec, patterns: Optional[list[str]] = None) -> list[ModelImpl]:
    """The implementations of the model's library, those matching ``patterns`` (fnmatch) when
    given. Raises ValueError for a pattern that matches none of them."""
    table = TRANSFORMERS_IMPLS if spec.library == "transformers" else IMPLS
    if not patterns:
        return list(table.values())
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in table):
            raise ValueError(
                f"--impl {pattern!r} matches no implementation for {spec.name}; known: {', '.join(table)}."
            )
    return [impl for name, impl in table.items() if any(fnmatch.fnmatchcase(name, p) for p in patterns)]
