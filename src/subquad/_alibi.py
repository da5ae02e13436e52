"""ALiBi, :mod:`subquad.mods`' built-in ``score_mod``: :func:`alibi` and :func:`alibi_slopes`."""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Union

import torch
from torch import Tensor


def alibi_slopes(
    num_heads: int, dtype: torch.dtype = torch.float32, device: Union[str, torch.device, int, None] = None
) -> Tensor:
    """The standard ALiBi slopes of ``num_heads`` heads (Press et al., 2022), shape ``(num_heads,)``.

    For a power of two ``n`` they are the geometric sequence ``2**(-8 (i+1) / n)``, i = 0..n-1
    (``n = 8``: 1/2, 1/4, ..., 1/256). Otherwise, with ``p`` the largest power of two below ``n``,
    the ``p`` slopes of ``p`` heads are followed by every other slope of ``2p`` heads (the odd
    exponents that interleave them), ``n - p`` of them.

    Raises:
        ValueError: ``num_heads`` is not a positive int.
    """
    if not isinstance(num_heads, int) or isinstance(num_heads, bool) or num_heads <= 0:
        raise ValueError(f"alibi_slopes: expected num_heads to be a positive int, got {num_heads!r}.")

    def geometric(n: int) -> List[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    p = 1 << (num_heads.bit_length() - 1)
    slopes = geometric(p)
    if p != num_heads:
        slopes += geometric(2 * p)[0::2][: num_heads - p]
    return torch.tensor(slopes, dtype=torch.float64).to(dtype=dtype, device=device)


class _Alibi:
    """``score - slopes[h] * |q_idx - kv_idx|``; ``slopes`` may require grad."""

    def __init__(self, slopes: Tensor) -> None:
        self.slopes = slopes

    @staticmethod
    def _distance(q_idx: Tensor, kv_idx: Tensor, dtype: torch.dtype) -> Tensor:
        # Distances in the float dtype directly: an int64 (qc, kc) temporary would double the traffic.
        return torch.sub(q_idx.to(dtype), kv_idx.to(dtype)).abs_()

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # Differentiable in the slopes (the matmul path pulls dS back through this expression).
        slopes = self.slopes.to(device=score.device, dtype=score.dtype)
        # One fused pass over the tile (score - slope * distance), differentiable in both.
        return torch.addcmul(score, slopes[h], self._distance(q_idx, kv_idx, score.dtype), value=-1.0)

    def additive_bias(
        self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor, out: Optional[Tensor] = None
    ) -> Tensor:
        """The bias ``-slopes[h] * |q_idx - kv_idx|`` of a tile, ``(1, Hq, qc, kc)``.

        ``out``: an optional buffer of that shape to write into (a caller that reuses one across
        tiles saves a fresh tile's page faults).
        """
        if out is not None:
            dtype = out.dtype
        else:
            dtype = self.slopes.dtype if self.slopes.is_floating_point() else torch.float32
        with torch.no_grad():
            dist = self._distance(q_idx, kv_idx, dtype)
            neg = self.slopes.to(device=q_idx.device, dtype=dtype)[h].neg()
            # Expanding the distances first matters: ``(1,1,qc,kc) * (1,H,1,1)`` into a fresh tensor
            # iterates badly on CPU (several times slower).
            return torch.mul(dist.expand(*dist.shape[:1], neg.shape[1], *dist.shape[2:]), neg, out=out)

    def __repr__(self) -> str:
        return f"alibi({self.slopes.detach().tolist()})"


def alibi(slopes: Union[int, Sequence[float], Tensor]) -> Callable[..., Tensor]:
    """ALiBi position bias (Press et al., 2022): ``score - slopes[h] * |q_idx - kv_idx|``.

    ``slopes``: one per query head, shape ``(Hq,)``, or an int ``H`` for :func:`alibi_slopes` ``(H)``.
    A tensor that requires grad (learnable slopes) receives its gradient through
    :func:`subquad.attention`'s backward. Without grad the mod runs on the fused CPU kernel.

    ::

        bias of one head, slope m, Lq = Lk = 4 (with causal(): the upper triangle is masked)
         0  -m -2m -3m
        -m   0  -m -2m
        -2m -m   0  -m
        -3m -2m -m   0

    Raises:
        ValueError: slopes that are not a 1-D float tensor / sequence or a positive int.
    """
    if isinstance(slopes, int) and not isinstance(slopes, bool):
        return _Alibi(alibi_slopes(slopes))
    t = slopes if isinstance(slopes, Tensor) else torch.as_tensor(slopes, dtype=torch.float32)
    if t.dim() != 1 or not t.is_floating_point():
        raise ValueError(
            f"alibi: expected slopes to be a 1-D float tensor of shape (Hq,) or a number of heads, "
            f"got {tuple(t.shape)} {t.dtype}."
        )
    return _Alibi(t)
