"""``patch_sdpa``: route ``torch.nn.functional.scaled_dot_product_attention`` to ``subquad.sdpa``.

For code that calls SDPA and offers no hook (a model's own attention, a third-party block), this
swaps the function on the ``torch.nn.functional`` module while any ``with`` block is active.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Dict, List, Optional

import torch.nn.functional as F

# Captured when subquad is imported, before anyone can have patched it.
ORIGINAL_SDPA: Callable[..., Any] = F.scaled_dot_product_attention

# The keyword-only options of ``subquad.attention`` that make sense for every SDPA call.
# ``return_lse`` is left out: it changes what the function returns, and callers of SDPA expect
# one tensor.
PATCH_OPTIONS = ("score_mod", "mask_mod", "memory_budget", "chunk_size", "backend", "allow_compile")


def check_options(options: Dict[str, Any], allowed: tuple = PATCH_OPTIONS, where: str = "patch_sdpa") -> Dict[str, Any]:
    """Reject unknown attention options early, with the list of the known ones."""
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(
            f"{where}() got unexpected option(s) {', '.join(map(repr, unknown))}; "
            f"the options it accepts are {', '.join(allowed)}."
        )
    return dict(options)


class _Registry:
    """The active ``patch_sdpa`` blocks of the process, in the order they were entered.

    The first block to enter installs the patch, the last to exit removes it, whatever the order
    in which blocks exit (threads, or ``__exit__`` calls out of LIFO order).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active: List["patch_sdpa"] = []
        self.replaced: Optional[Callable[..., Any]] = None  # what F.scaled_dot_product_attention was
        self.torch_function: Any = None  # CausalBias.__torch_function__ as torch defines it
        self.calling = threading.local()  # set while subquad runs a patched call in this thread

    def options(self) -> Optional[Dict[str, Any]]:
        """The options for a call from this thread: its own innermost block, else the newest block."""
        me = threading.get_ident()
        active = self.active[:]  # a consistent snapshot without taking the lock on every call
        for block in reversed(active):
            if block.thread == me:
                return block.options
        return active[-1].options if active else None

    def enter(self, block: "patch_sdpa") -> None:
        with self.lock:
            if not self.active:
                self.replaced = F.scaled_dot_product_attention
                F.scaled_dot_product_attention = _patched_sdpa
                self.torch_function = _install_causal_bias_dispatch()
            self.active.append(block)

    def exit(self, block: "patch_sdpa") -> None:
        with self.lock:
            if block in self.active:
                self.active.remove(block)
            if not self.active and self.replaced is not None:
                F.scaled_dot_product_attention = self.replaced
                self.replaced = None
                _remove_causal_bias_dispatch(self.torch_function)
                self.torch_function = None


_REGISTRY = _Registry()


@functools.wraps(ORIGINAL_SDPA)
def _patched_sdpa(
    query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
    scale: Any = None, enable_gqa: bool = False,
) -> Any:
    options = _REGISTRY.options()
    if options is None or getattr(_REGISTRY.calling, "active", False):
        # No block is active any more (the function was bound while one was), or subquad itself
        # is running: torch's own function.
        return ORIGINAL_SDPA(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        )
    import subquad

    _REGISTRY.calling.active = True
    try:
        return subquad.sdpa(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, **options,
        )
    finally:
        _REGISTRY.calling.active = False


def _install_causal_bias_dispatch() -> Any:
    """Keep torch's ``CausalBias`` masks working in code that bound torch's SDPA before the patch.

    ``CausalBias.__torch_function__`` recognizes SDPA by ``func is F.scaled_dot_product_attention``,
    which is the patched function while a block is active; a call through torch's own function
    would then read the mask (a tensor without data) as a float mask. This version also accepts
    torch's function and dispatches such calls as torch does.
    """
    try:
        from torch.nn.attention.bias import CausalBias
    except ImportError:
        return None
    original = CausalBias.__dict__.get("__torch_function__")
    if original is None:
        return None

    def __torch_function__(cls: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is ORIGINAL_SDPA:
            return cls._dispatch(*args, **(kwargs or {}))
        return original.__get__(None, cls)(func, types, args, kwargs)

    CausalBias.__torch_function__ = classmethod(__torch_function__)  # type: ignore[assignment]
    return original


def _remove_causal_bias_dispatch(original: Any) -> None:
    if original is None:
        return
    from torch.nn.attention.bias import CausalBias

    CausalBias.__torch_function__ = original  # type: ignore[assignment]


class patch_sdpa:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` to ``subquad.sdpa`` inside a block.

    ::

        with subquad.patch_sdpa(memory_budget="1GiB"):
            image = pipe(prompt).images[0]    # every F.scaled_dot_product_attention call
                                              # runs as subquad.sdpa(..., memory_budget="1GiB")

    Calls keep SDPA's signature and semantics (bool mask True = attend, float mask added,
    ``is_causal`` top-left, ``enable_gqa``, torch's ``CausalBias`` masks); ``attention_options``
    (``memory_budget``, ``chunk_size``, ``backend``, ``score_mod``, ``mask_mod``) are added to
    every call. A call made while subquad itself is running goes to torch's function.

    Blocks and threads: the function is replaced on the ``torch.nn.functional`` module, so the
    patch is process-wide while any block is active, and torch's function comes back when the
    last active block exits, whatever the order in which blocks exit (also when a body raises).
    A call uses the options of the innermost active block entered by its own thread; a thread
    that entered none (a worker thread, autograd's threads) gets the options of the most
    recently entered block still active.

    Not patched: code that bound the function before the first block (``from
    torch.nn.functional import scaled_dot_product_attention`` at import time) keeps calling
    torch's SDPA.

    Raises:
        TypeError: an option that ``subquad.attention`` does not take, or ``return_lse``.
    """

    def __init__(self, **attention_options: Any) -> None:
        self.options = check_options(attention_options)
        self.thread: Optional[int] = None

    def __enter__(self) -> None:
        if self.thread is not None:
            raise RuntimeError("this patch_sdpa block is already active; create a new one to nest")
        self.thread = threading.get_ident()
        _REGISTRY.enter(self)

    def __exit__(self, *exc: Any) -> None:
        _REGISTRY.exit(self)
        self.thread = None
