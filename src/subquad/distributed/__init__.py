r"""Exact attention over a sequence sharded across processes (context parallelism).

Each rank holds its shard of the sequence, ``(..., H, L/P, E)``; the ranks compute the attention
of the whole sequence together over ``torch.distributed`` (gloo on CPU, NCCL on GPUs, launched
with ``torchrun``), with no transport of subquad's own. Two strategies:

* **ring** (:func:`ring_attention`): key/value shards travel around the ring of ranks with
  point-to-point sends (``batch_isend_irecv``), the next transfer posted before the current
  step's compute; each step is a bounded-memory :mod:`subquad` call with ``return_lse``, and the
  partial results merge exactly by their log-sum-exp. The backward sends dK/dV around the ring
  with K/V (FlashAttention-2: it needs only the saved output and global lse). Nothing of size
  ``L x L`` exists on any rank, forward or backward.
* **all-to-all** (:func:`ulysses_attention`, "Ulysses"): two all-to-alls turn the sequence
  shards into head shards (the whole sequence for ``H/P`` heads), each rank runs
  :func:`subquad.attention` on its heads, and one all-to-all brings the output back.

:func:`attention` picks one (``strategy="auto"``) and :func:`explain` says which, with the
per-rank memory and bytes sent. :func:`shard` / :func:`unshard` split a whole tensor into this
rank's shard and gather it back, in either layout:

* ``layout="zigzag"`` (default): the sequence is cut into ``2P`` equal chunks and rank ``r``
  holds chunks ``r`` and ``2P-1-r``, so that every rank does the same causal work;
* ``layout="contiguous"``: rank ``r`` holds the ``r``-th run of positions (shards may differ
  in length).

Positions are global: ``score_mod``/``mask_mod`` see the global query and key index of every
element, so ALiBi, sliding windows and document masks are exact across shards.

A failure on one rank (an exception in a callback, a lost process) leaves the others waiting on
their next transfer until the process group's timeout (``init_process_group(timeout=...)``;
gloo's default is 30 minutes), when they raise. Invalid arguments are checked on every rank
before any transfer, so that all ranks raise together.
"""

from ._agreement import STRATEGIES
from ._face import attention, explain, ring_attention, ulysses_attention
from ._group import STATS
from ._layouts import LAYOUTS, shard, unshard
from ._plan import DistributedPlan

__all__ = [
    "ring_attention",
    "ulysses_attention",
    "attention",
    "explain",
    "shard",
    "unshard",
    "DistributedPlan",
    "LAYOUTS",
    "STRATEGIES",
    "STATS",
]
