"""subquad for JAX: exact attention computed in chunks, so no ``T x S`` array exists.

Shape legend (JAX's, as in ``jax.nn.dot_product_attention``)::

    B  batch            T  query length (target)     S  key/value length (source)
    N  query heads      K  key/value heads (N = K * G, GQA when K < N)
    H  head dim of query and key                     Hv head dim of value (= H in the drop-in)

Inputs are ``(B, T, N, H)`` query, ``(B, S, K, H)`` key, ``(B, S, K, Hv)`` value (or without the
batch axis). Everything runs in ``jax.lax`` loops over query and key chunks with an online softmax
in float32; the backward (``jax.custom_vjp``) recomputes each chunk's probabilities from the saved
log-sum-exp, FlashAttention-2 style. Works under ``jit``, ``grad`` and ``vmap``.

* :func:`dot_product_attention`: a drop-in for ``jax.nn.dot_product_attention``.
* :func:`attention`: the same plus ``score_mod``/``mask_mod`` callbacks, ``chunk_size``,
  ``memory_budget`` and ``return_lse``; rows that see no key give 0 (lse ``-inf``).
* :func:`explain`: the chunks a call would use and the memory model's figure.
* Beyond one device (context parallelism): :func:`ring_attention` and :func:`ulysses_attention`
  inside ``jax.shard_map``; ``attention(..., mesh=...)`` applies ``shard_map`` itself to globally
  sharded arrays and picks the strategy; :func:`shard`/:func:`unshard` put a whole sequence in a
  layout's order (``zigzag``: device ``r`` holds chunks ``r`` and ``2P-1-r`` of ``2P``).

``import subquad`` never imports JAX; ``import subquad.jax`` does (``pip install subquad[jax]``), and
needs no PyTorch (without it, the rest of ``subquad`` says what to install).
"""

from __future__ import annotations

try:
    import jax  # noqa: F401 (the optional dependency: fail here, with how to install it)
except ImportError as e:  # pragma: no cover - exercised only without jax
    raise ImportError("subquad.jax needs JAX: pip install 'subquad[jax]' (or pip install jax).") from e

from .._errors import MemoryBudgetError
from ._api import attention, dot_product_attention, explain, ring_attention, ulysses_attention
from ._call import DEFAULT_CHUNKS, DtypeError
from ._layouts import LAYOUTS, shard, unshard
from ._plan import STRATEGIES, ShardedPlan

__all__ = [
    "attention",
    "dot_product_attention",
    "explain",
    "ring_attention",
    "ulysses_attention",
    "shard",
    "unshard",
    "MemoryBudgetError",
    "DtypeError",
    "DEFAULT_CHUNKS",
    "LAYOUTS",
    "STRATEGIES",
    "ShardedPlan",
]
