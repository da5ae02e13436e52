"""Block states off the CPU, simulated (issue 27, defects 3 and 7; tests/_devices.py).

- Defect 7: a document mask's block states read its ids, which on a GPU live on the device; asked
  per tile, each answer was a device -> host wait (2 per tile, 16,384 ``block_state`` calls to
  build the flex BlockMask of ``and_masks(causal(), document(ids))`` at L = 16384). They are now
  computed for the whole grid at once and read back once.
- Defect 3: the flex BlockMask combined CPU block states with a ``mask_mod`` evaluated on the call's
  device ("Expected all tensors to be on the same device"), outside the fallback to the tiles.
  It is built on the call's device now, and any failure to build it runs the tiles instead.
"""

from __future__ import annotations

import collections

import pytest
import torch

import subquad
from _devices import OpRecorder, as_device
from conftest import assert_close_to_golden, naive_attention, to64
from subquad import _call, _callbacks, mods
from subquad._backends import flex
from subquad._tiles import TILES


def _qkv(L, dtype=torch.float64, H=2):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, H, L, 16, generator=g, dtype=dtype) for _ in range(3)]


def _documents(L, size):
    return torch.arange(L) // size  # sorted ids: documents of `size` tokens


def _hand_written_document(ids):
    # FlexAttention's document mask, as its tutorial writes it: no declared block states.
    return lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx]


class _CountTolist:
    """Counts ``Tensor.tolist`` calls: the reads of a grid of states back to the host."""

    def __init__(self, monkeypatch):
        self.calls = 0
        original = torch.Tensor.tolist

        def tolist(t):
            self.calls += 1
            return original(t)

        monkeypatch.setattr(torch.Tensor, "tolist", tolist)


# ----------------------------------------------------------------- defect 7: the tile loop
def _on_cpu_then_cuda(monkeypatch, q, k, v, mask, c):
    """The call's tiles on the CPU, then with the CUDA branches forced: ``(cpu out, cpu tile
    counts, cuda out, state reads, op recorder)``."""
    TILES.reset()
    cpu = subquad.attention(q, k, v, mask_mod=mask, backend="matmul", chunk_size=c)
    on_cpu = (TILES.computed, TILES.skipped)
    as_device(monkeypatch, "cuda")
    reads = _CountTolist(monkeypatch)
    TILES.reset()
    with OpRecorder() as rec:
        out = subquad.attention(q, k, v, mask_mod=mask, backend="matmul", chunk_size=c)
    return cpu, on_cpu, out, reads, rec


def test_a_document_mask_on_a_gpu_reads_its_tile_states_once_not_per_tile(monkeypatch):
    # Before: document(ids).block_state per tile, two bool(tensor) waits each (322 waits here).
    L, c = 1024, 64  # 16 x 16 tiles
    q, k, v = _qkv(L)
    mask = mods.and_masks(mods.causal(), mods.document(_documents(L, 100)))
    golden = naive_attention(q, k, v, mask_mod=mask)
    cpu, on_cpu, out, reads, rec = _on_cpu_then_cuda(monkeypatch, q, k, v, mask, c)
    assert rec.syncs == 0, rec.summary()
    assert reads.calls <= 1  # the grid's states, once for the call
    assert (TILES.computed, TILES.skipped) == on_cpu and TILES.skipped > 100
    assert_close_to_golden(out, golden)
    assert_close_to_golden(cpu, golden)


def test_a_hand_written_mask_on_a_gpu_is_evaluated_a_block_row_at_a_time(monkeypatch):
    # Before: each tile's mask was evaluated and tested with two bool(tensor) waits.
    L, c = 512, 64  # 8 x 8 tiles
    q, k, v = _qkv(L)
    ids = _documents(L, 150)
    mask = mods.and_masks(mods.causal(), _hand_written_document(ids))
    golden = naive_attention(q, k, v, mask_mod=mask)
    _, on_cpu, out, reads, rec = _on_cpu_then_cuda(monkeypatch, q, k, v, mask, c)
    assert rec.syncs == 0, rec.summary()
    assert reads.calls <= 1 + L // c  # the declared grid, then one read per block row
    assert (TILES.computed, TILES.skipped) == on_cpu
    assert_close_to_golden(out, golden)


def test_tile_states_come_a_band_of_block_rows_at_a_time(monkeypatch):
    # A grid larger than a band is read in bands; a tile loop over it gives the same result.
    monkeypatch.setattr(_callbacks.TileStates, "BAND", 20)  # 16 key tiles: one block row per band
    L, c = 256, 16
    q, k, v = _qkv(L, H=1)
    mask = mods.and_masks(mods.sliding_window(40), mods.document(_documents(L, 70)))
    as_device(monkeypatch, "cuda")
    reads = _CountTolist(monkeypatch)
    with OpRecorder() as rec:
        out = subquad.attention(q, k, v, mask_mod=mask, backend="matmul", chunk_size=c)
    assert rec.syncs == 0 and reads.calls == L // c
    assert_close_to_golden(out, naive_attention(q, k, v, mask_mod=mask))


# ----------------------------------------------------------------- defect 7: the flex BlockMask
def _inputs(L, mask_mod):
    q = torch.zeros(1, 1, L, 16)
    return _call.prepare(q, q, q, mask_mod=mask_mod, allow_compile=True).inp


def _nonempty_blocks(mask_mod, L, block=flex.BLOCK):
    i, zero = torch.arange(L), torch.zeros(1, 1, 1, 1, dtype=torch.long)
    keep = mask_mod(zero, zero, i.view(1, 1, -1, 1), i.view(1, 1, 1, -1))
    n = L // block
    return int(keep.reshape(n, block, n, block).any(dim=3).any(dim=1).sum())


@pytest.mark.parametrize("kind", ["document", "hand-written"])
def test_the_flex_block_mask_reads_the_device_at_most_once(monkeypatch, kind):
    # Before: 2 waits per block for document(ids) (and_masks(causal(), document(ids)) at L = 16384:
    # 16,384 block_state calls, 17,735 waits, 2.1 s on a CPU); a hand-written mask: one
    # nonzero() per block row.
    L = 2048  # 16 x 16 blocks
    ids = _documents(L, 300)
    part = mods.document(ids) if kind == "document" else _hand_written_document(ids)
    mask = mods.and_masks(mods.causal(), part)
    inp = _inputs(L, mask)
    as_device(monkeypatch, "cuda")
    monkeypatch.setattr(flex, "_BLOCK_MASKS", collections.OrderedDict())
    with OpRecorder() as rec:
        _, (computed, skipped) = flex.Flex().block_mask(inp)
    assert rec.syncs <= 1, rec.summary()
    # Sorted ids of consecutive integers: the block states are exact, no empty block is computed.
    assert (computed, skipped) == (_nonempty_blocks(mask, L), 256 - computed)


def test_block_states_of_a_grid_are_block_state_of_each_tile():
    B, Lq, Lk = 2, 23, 31
    g = torch.Generator().manual_seed(1)
    q_ids = torch.randint(0, 4, (B, Lq), generator=g).sort().values
    kv_ids = torch.randint(0, 4, (B, Lk), generator=g).sort().values
    hand = lambda b, h, q, kv: (q + kv) % 3 != 0  # noqa: E731 - declares nothing
    masks = {
        "causal": mods.causal(),
        "causal_lower_right": mods.causal_lower_right(Lq, Lk),
        "sliding_window": mods.sliding_window(3),
        "sliding_window_causal": mods.sliding_window(4, causal=True),
        "local_window": mods.local_window(2, None, 5),
        "local_window_right": mods.local_window(None, 3, -2),
        "document": mods.document(q_ids, kv_ids),
        "document_shared": mods.document(q_ids[0]),
        "document_past_its_ids": mods.document(q_ids[:, :9], kv_ids[:, :13]),
        "key_padding": mods.key_padding(torch.tensor([5, 17])),
        "prefix_lm": mods.prefix_lm(torch.tensor([3, 12])),
        "and": mods.and_masks(mods.causal(), mods.document(q_ids, kv_ids)),
        "or": mods.or_masks(mods.sliding_window(2), mods.key_padding(4)),
        "and_hand_written": mods.and_masks(mods.causal(), hand),
        "or_hand_written": mods.or_masks(mods.causal(), hand),
    }
    for name, mask in masks.items():
        for qb, kb in [(1, 1), (4, 5), (7, 3), (100, 100)]:
            for qs, qe, ks, ke in [(0, Lq, 0, Lk), (3, 20, 2, 29)]:
                grid = _callbacks.declared_states(mask, qs, qe, qb, ks, ke, kb)
                expected = [
                    [mask.block_state(q0, min(q0 + qb, qe), k0, min(k0 + kb, ke)) for k0 in range(ks, ke, kb)]
                    for q0 in range(qs, qe, qb)
                ]
                expected = [[_callbacks.UNKNOWN if s is None else s for s in row] for row in expected]
                assert grid is not None and grid.tolist() == expected, f"{name}, blocks {qb} x {kb}"
    assert _callbacks.declared_states(mods.and_masks(hand, hand), 0, Lq, 4, 0, Lk, 4) is None


# ----------------------------------------------------------------- defect 3: falling back
@pytest.mark.skipif(flex._flex_unavailable_reason() is not None, reason="no FlexAttention in this torch")
def test_a_block_mask_that_cannot_be_built_runs_the_tiles(monkeypatch):
    # Before: CPU block states met a mask evaluated on the GPU outside run_whole's try; the
    # error reached the caller. The failure simulated here is the one the issue reports.
    def on_two_devices(*args, **kwargs):
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"
        )

    monkeypatch.setattr(flex, "_evaluated_row", on_two_devices)
    monkeypatch.setattr(flex, "_BLOCK_MASKS", collections.OrderedDict())
    monkeypatch.setattr(flex, "_NO_BLOCK_MASK", {}, raising=False)
    L = 1024
    q, k, v = _qkv(L, dtype=torch.float32)
    mask = _hand_written_document(_documents(L, 200))
    assert subquad.explain(q, k, v, mask_mod=mask, allow_compile=True).backend == "flex"
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="BlockMask could not be built: RuntimeError: Expected all tensors"):
            out = subquad.attention(q, k, v, mask_mod=mask, allow_compile=True)
        plan = subquad.explain(q, k, v, mask_mod=mask, allow_compile=True)  # not tried again
    assert_close_to_golden(out, naive_attention(*to64(q, k, v), mask_mod=mask), naive_attention(q, k, v, mask_mod=mask))
    assert plan.backend != "flex"
    assert "building the BlockMask of this signature failed before (RuntimeError: Expected all tensors" in str(plan)
