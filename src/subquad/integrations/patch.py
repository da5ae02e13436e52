"""``patch_sdpa``: route ``torch.nn.functional.scaled_dot_product_attention`` to ``subquad.sdpa``.

For code that calls SDPA and offers no hook (a model's own attention, a third-party block), this
swaps the function on the ``torch.nn.functional`` module for the duration of a ``with`` block.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Dict, Iterator

import torch.nn.functional as F

# Captured when subquad is imported, before anyone can have patched it.
ORIGINAL_SDPA: Callable[..., Any] = F.scaled_dot_product_attention

# The keyword-only options of ``subquad.attention`` that make sense for every SDPA call.
# ``return_lse`` is left out: it changes what the function returns, and callers of SDPA expect
# one tensor.
PATCH_OPTIONS = ("score_mod", "mask_mod", "memory_budget", "chunk_size", "backend")

_state = threading.local()


def check_options(options: Dict[str, Any], allowed: tuple = PATCH_OPTIONS, where: str = "patch_sdpa") -> Dict[str, Any]:
    """Reject unknown attention options early, with the list of the known ones."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(
            f"{where}() got unexpected option(s) {', '.join(map(repr, unknown))}; "
            f"the options it accepts are {', '.join(allowed)}."
        )
    return dict(options)


@contextlib.contextmanager
def patch_sdpa(**attention_options: Any) -> Iterator[None]:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` to ``subquad.sdpa`` inside a block.

    ::

        with subquad.patch_sdpa(memory_budget="1GiB"):
            image = pipe(prompt).images[0]    # every F.scaled_dot_product_attention call
                                              # runs as subquad.sdpa(..., memory_budget="1GiB")

    Calls keep SDPA's signature and semantics (bool mask True = attend, float mask added,
    ``is_causal`` top-left, ``enable_gqa``); ``attention_options`` (``memory_budget``,
    ``chunk_size``, ``backend``, ``score_mod``, ``mask_mod``) are added to every call.

    The original function is always restored on exit, also when the body raises. Blocks nest:
    the innermost options win, and each exit restores what its entry found. A call made while
    subquad itself is running (its engine may use SDPA per tile) goes to the original function.

    Not patched: code that bound the function before the block (``from torch.nn.functional
    import scaled_dot_product_attention`` at import time), and other threads see the patch too,
    since it replaces a module attribute.

    Raises:
        TypeError: an option that ``subquad.attention`` does not take, or ``return_lse``.
    """
    options = check_options(attention_options)
    import subquad

    sdpa = subquad.sdpa

    @functools.wraps(ORIGINAL_SDPA)
    def scaled_dot_product_attention(
        query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        if getattr(_state, "depth", 0):
            return ORIGINAL_SDPA(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
            )
        _state.depth = 1
        try:
            return sdpa(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, **options,
            )
        finally:
            _state.depth = 0

    previous = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = previous
