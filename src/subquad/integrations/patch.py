"""``patch_sdpa``: route ``torch.nn.functional.scaled_dot_product_attention`` to ``subquad.sdpa``.

For code that calls SDPA and offers no hook (a model's own attention, a third-party block), this
swaps the function on the ``torch.nn.functional`` module while any ``with`` block is active.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch.nn.functional as F

import subquad

from .._for_wings import TORCH_SDPA

_CausalBias: Any  # the class, its __torch_function__ swapped while a block is active; or None
try:
    from torch.nn.attention.bias import CausalBias as _CausalBias
except ImportError:  # a torch without the module has no such masks either
    _CausalBias = None

ORIGINAL_SDPA: Callable[..., Any] = TORCH_SDPA
"""Torch's own SDPA (its builtin), whatever ``F.scaled_dot_product_attention`` was when this was imported."""

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


class _Hold:
    """What keeps a block active: the block is active exactly as long as its hold is alive."""

    __slots__ = ("__weakref__",)


class _Registry:
    """The active ``patch_sdpa`` blocks of the process, in the order they were entered.

    The registry is the truth; ``F.scaled_dot_product_attention`` and ``CausalBias``'s dispatch
    follow it (:meth:`sync`): patched while any block is active, torch's once none is, whatever the
    order in which blocks exit (threads, or ``__exit__`` calls out of LIFO order).

    Ctrl-C (an asynchronous ``KeyboardInterrupt``) can arrive wherever Python checks for it: at
    the start of a function, after a call returns, at a loop's backward jump. So:

    * a block is live while its :class:`_Hold` is: a ``with`` statement's exit function holds it
      (:class:`_ExitFunction`), and when the statement drops that function the hold dies and
      the block's entry leaves :attr:`live` by a C callback, with no Python frame that an
      interrupt could stop -- even one that lands as ``__exit__`` starts;
    * :meth:`_sync` makes no call between its loads and stores, so it completes or does not start;
    * an entry or exit that an interrupt cuts short is undone or done again by ``patch_sdpa``,
      and the patched function, called while no block is live, puts torch's back.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.entries: List[Tuple[Any, "patch_sdpa", Any]] = []  # (entry, block, tidy ref), in order
        self.live: Set[Any] = set()  # the entries (weak references to holds) still alive
        self.replaced: Callable[..., Any] = TORCH_SDPA  # what F.scaled_dot_product_attention was
        self.bias_patched = False
        self.calling = threading.local()  # set while subquad runs a patched call in this thread

    def blocks(self) -> List["patch_sdpa"]:
        """The live blocks, oldest first (a snapshot, without the lock)."""
        live = self.live
        return [block for entry, block, _ in self.entries[:] if entry in live]

    def options(self) -> Optional[Dict[str, Any]]:
        """The options for a call from this thread: its own innermost block, else the newest block."""
        me = threading.get_ident()
        blocks = self.blocks()
        for block in reversed(blocks):
            if block.thread == me:
                return block.options
        return blocks[-1].options if blocks else None

    def enter(self, block: "patch_sdpa", hold: _Hold) -> None:
        tidy = weakref.ref(hold, _tidy)  # created first, so it runs after the entry is discarded
        block.entry = entry = weakref.ref(hold, self.live.discard)  # before it is live: exit() finds it
        with self.lock:
            self.live.add(entry)
            self.entries.append((entry, block, tidy))
            self._sync()

    def exit(self, block: "patch_sdpa") -> None:
        with self.lock:
            self.live.discard(block.entry)
            self.entries = [e for e in self.entries if e[1] is not block and e[0] in self.live]
            self._sync()

    def sync(self) -> None:
        with self.lock:
            self._sync()

    def _sync(self) -> None:
        # Attribute loads, stores and comparisons only (no call): see the class docstring.
        patched = F.scaled_dot_product_attention is _patched_sdpa
        if self.live:
            if not patched:
                self.replaced = F.scaled_dot_product_attention
                F.scaled_dot_product_attention = _patched_sdpa
            if _CausalBias is not None and not self.bias_patched:
                _CausalBias.__torch_function__ = _BIAS_DISPATCH
                self.bias_patched = True
            return
        if patched:  # (someone else's wrapper installed over ours is theirs to remove)
            F.scaled_dot_product_attention = self.replaced
        if self.bias_patched:
            _CausalBias.__torch_function__ = _TORCH_BIAS_DISPATCH
            self.bias_patched = False


_REGISTRY = _Registry()


def _tidy(_hold: Any) -> None:
    # A with statement dropped a block's hold: torch's function comes back now if no block is live.
    _REGISTRY.sync()


@functools.wraps(TORCH_SDPA)
def _patched_sdpa(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Any = None,
    enable_gqa: bool = False,
) -> Any:
    options = _REGISTRY.options()
    calling = _REGISTRY.calling
    if options is None or getattr(calling, "active", False):
        # No block is active any more (the function was bound while one was, or an interrupt
        # cut an exit short: put torch's back), or subquad itself is running: torch's own function.
        if options is None:
            _REGISTRY.sync()
        return TORCH_SDPA(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    try:
        calling.active = True
        return subquad.sdpa(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
            **options,
        )
    finally:
        calling.active = False


def _bias_dispatch(cls: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    """Keep torch's ``CausalBias`` masks working in code that bound torch's SDPA before the patch.

    ``CausalBias.__torch_function__`` recognizes SDPA by ``func is F.scaled_dot_product_attention``,
    which is the patched function while a block is active; a call through torch's own function
    would then read the mask (a tensor without data) as a float mask. This version, installed
    while a block is active, also accepts torch's function and dispatches such calls as torch does.
    """
    if func is TORCH_SDPA:
        return cls._dispatch(*args, **(kwargs or {}))
    return _TORCH_BIAS_DISPATCH.__get__(None, cls)(func, types, args, kwargs)


# Built once here, so that installing and removing them in _Registry._sync makes no call.
_TORCH_BIAS_DISPATCH: Any = None if _CausalBias is None else _CausalBias.__dict__.get("__torch_function__")
_BIAS_DISPATCH = classmethod(_bias_dispatch)
if _TORCH_BIAS_DISPATCH is None:
    _CausalBias = None


class _ExitFunction:
    """``patch_sdpa.__exit__``: the exit function carries the block's hold.

    A ``with`` statement looks ``__exit__`` up before it calls ``__enter__`` and keeps the
    function until the block ends, so the block stays live exactly as long as the statement
    needs it, even if an interrupt stops ``__exit__`` before its first line: the statement drops
    the function either way. (A block entered by calling ``__enter__()`` holds itself until
    ``__exit__()``.)
    """

    def __get__(self, block: Any, owner: Any = None) -> Any:
        if block is None:  # looked up on the class (contextlib.ExitStack does): the plain function
            return owner._exit
        exit_function: Any = functools.partial(type(block)._exit, block)  # it carries a hold
        if block.entry is None or block.entry not in _REGISTRY.live:
            exit_function.hold = hold = _Hold()
            block._exit_hold = weakref.ref(hold)
        return exit_function


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
    torch's SDPA. "Torch's function" is always torch's own builtin, also when another wrapper had
    replaced ``F.scaled_dot_product_attention`` before subquad was imported.

    Ctrl-C: an interrupt at any moment of a ``with patch_sdpa(...)`` statement -- entering it,
    inside a patched call, exiting it -- leaves no block active once the statement is left, and
    torch's function back in place. (A block entered and exited by calling ``__enter__()`` and
    ``__exit__()`` directly is as interruptible as those calls: an interrupt that stops the
    ``__exit__()`` call before it starts leaves that block active.)

    Raises:
        TypeError: an option that ``subquad.attention`` does not take, or ``return_lse``.
    """

    def __init__(self, **attention_options: Any) -> None:
        self.options = check_options(attention_options)
        self.thread: Optional[int] = None
        self.entry: Any = None  # this block's entry in the registry (a weak reference to its hold)
        self._exit_hold: Any = None  # weakly, the hold that a with statement's exit function carries
        self._held: Optional[_Hold] = None  # the hold, for a block entered by a direct __enter__()

    def __enter__(self) -> None:
        if self.entry is not None and self.entry in _REGISTRY.live:
            raise RuntimeError("this patch_sdpa block is already active; create a new one to nest")
        hold = self._exit_hold() if self._exit_hold is not None else None
        self._exit_hold = None
        try:
            if hold is None:  # entered by hand (or by contextlib.ExitStack): the block holds itself
                hold = self._held = _Hold()
            self.thread = threading.get_ident()
            _REGISTRY.enter(self, hold)
        except BaseException:
            # An interrupt (Ctrl-C) during the entry: the with statement will not call __exit__.
            _REGISTRY.exit(self)
            self.thread = self._held = None
            raise

    def _exit(self, *exc: Any) -> None:
        try:
            _REGISTRY.exit(self)
        finally:
            # Again (it is idempotent) if an interrupt cut the first one short.
            _REGISTRY.exit(self)
            self.thread = self._held = None

    __exit__ = _ExitFunction()
