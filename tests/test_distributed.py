"""subquad.distributed on 2 and 4 gloo ranks (spawned once per group size), against subquad.attention.

Each rank compares its shard of the output, lse and gradients with the single-process call on
the whole inputs in float64 (tests/_distributed_cases.py).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from typing import Any, Dict, List

import pytest
import torch

import _distributed_cases as cases
import subquad
from subquad import distributed as sd

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(P: int, names: List[str], extras: List[str], honest_rss: bool = False) -> List[Dict[str, Any]]:
    import torch.multiprocessing as mp

    old = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if honest_rss:  # freed tensors go back to the OS (slower: only for the memory measurement)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            mp.spawn(cases.worker, args=(P, _free_port(), names, out_dir, extras), nprocs=P, join=True)
            results = []
            for r in range(P):
                with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                    results.append(json.load(f))
            return results
    finally:
        if old is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = old


@pytest.fixture(scope="module")
def two_ranks() -> List[Dict[str, Any]]:
    return _spawn(2, list(cases.CASES), ["errors", "singletons", "timeout"])


@pytest.fixture(scope="module")
def two_ranks_memory() -> List[Dict[str, Any]]:
    return _spawn(2, [], ["memory"], honest_rss=True)


@pytest.fixture(scope="module")
def four_ranks() -> List[Dict[str, Any]]:
    return _spawn(4, cases.QUICK, [])


def _check(results: List[Dict[str, Any]], name: str) -> None:
    for rank, res in enumerate(results):
        r = res[name]
        assert "error" not in r, f"rank {rank}: {r.get('error')}"
        assert r["shape_ok"] == 1.0 and r["out_dtype_ok"] == 1.0, f"rank {rank}: wrong shape or dtype"
        if "single_out" in r:  # low precision: within a few times what one process gets
            tol = 3 * r["single_out"] + 1e-2
            for key in ("out", "lse"):
                assert r[key] <= tol, f"rank {rank} {name} {key}: error {r[key]:.3g} > {tol:.3g}"
            for key in ("dq", "dk", "dv"):
                assert r[key] <= 0.1, f"rank {rank} {name} {key}: error {r[key]:.3g}"
            continue
        for key in ("out", "lse", "dq", "dk", "dv", "dmask", "dcaptured"):
            if key in r:
                assert r[key] <= 1e-10, f"rank {rank} {name} {key}: error {r[key]:.3g} against the float64 whole call"


@pytest.mark.parametrize("name", list(cases.CASES))
def test_two_ranks_match_one_process(two_ranks: List[Dict[str, Any]], name: str) -> None:
    _check(two_ranks, name)


@pytest.mark.parametrize("name", cases.QUICK)
def test_four_ranks_match_one_process(four_ranks: List[Dict[str, Any]], name: str) -> None:
    _check(four_ranks, name)


def test_masked_ring_steps_are_skipped(four_ranks: List[Dict[str, Any]]) -> None:
    # Contiguous causal: rank r needs the keys of ranks 0..r only; zigzag: no step is empty.
    for rank, res in enumerate(four_ranks):
        assert res["ring-causal-contiguous"]["skipped_steps"] == 4 - 1 - rank
        assert res["ring-causal-zigzag"]["skipped_steps"] == 0
    # Zigzag evens out the causal work: every rank runs the same number of attention calls.
    assert len({res["ring-causal-zigzag"]["blocks"] for res in four_ranks}) == 1


def test_long_blocks_run_as_several_calls(two_ranks: List[Dict[str, Any]]) -> None:
    # Sub-blocks of 16 rows: the 4 zigzag blocks of each rank become at least 8 calls.
    for res in two_ranks:
        assert res["ring-sub-blocks-causal"]["blocks"] >= 8
        assert res["ring-causal-zigzag"]["blocks"] == 4


def test_auto_strategy(two_ranks: List[Dict[str, Any]], four_ranks: List[Dict[str, Any]]) -> None:
    # P = 2 with equal heads: both send as much, the ring wins the tie; P = 4: the all-to-all sends less.
    assert two_ranks[0]["singletons"]["plan-strategy"] == "ring"
    assert "ulysses" in two_ranks[0]["singletons"]["plan-text"]
    for res in four_ranks:
        assert res["auto-causal"]["blocks"] == 0  # the all-to-all runs no ring block


def test_refusals_on_every_rank(two_ranks: List[Dict[str, Any]]) -> None:
    for rank, res in enumerate(two_ranks):
        errors = res["errors"]
        assert "error" not in errors, errors.get("error")
        bad = {k: v for k, v in errors.items() if v != "ok"}
        assert not bad, f"rank {rank}: {bad}"


def test_group_of_one_shard_unshard_explain(two_ranks: List[Dict[str, Any]]) -> None:
    for res in two_ranks:
        s = res["singletons"]
        assert "error" not in s, s.get("error")
        assert s["group-of-one"] <= 1e-12
        assert s["roundtrip-zigzag"] == s["roundtrip-contiguous"] == s["roundtrip-uneven"] == 0.0
        assert s["plan-peak"] > 0 and "per-rank peak" in s["plan-text"]
        # Zigzag causal, own keys: diagonal, below-diagonal and diagonal blocks; then one joined call.
        assert s["plan-steps"] == [3, 1]


def test_per_rank_memory_is_a_fraction(two_ranks_memory: List[Dict[str, Any]]) -> None:
    for rank, res in enumerate(two_ranks_memory):
        m = res["memory"]
        assert "error" not in m, m.get("error")
        # Beyond its shards: K/V in flight, float32 accumulators and an 8 MiB budget per block;
        # the scores of the whole sequence would be m["scores"] (256 MiB).
        bound = 16 * m["shard"] + 32 * 2**20
        assert m["peak"] < bound, f"rank {rank}: peak {m['peak'] / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"
        assert m["peak"] < m["scores"] / 4


def test_failure_on_one_rank_times_out_on_the_other(two_ranks: List[Dict[str, Any]]) -> None:
    r0, r1 = two_ranks[0]["timeout"], two_ranks[1]["timeout"]
    assert r0["raised"].startswith("ValueError: boom on rank 0")
    assert r1["raised"].startswith("RuntimeError"), r1
    assert r1["seconds"] < 30  # the group's timeout is 2 s; rank 0 stays alive for 4 s


def test_needs_a_process_group() -> None:
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialized in this process")
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="init_process_group"):
        sd.ring_attention(x, x, x)
    with pytest.raises(RuntimeError, match="init_process_group"):
        sd.shard(x, -2)


def test_import_subquad_does_not_import_distributed_module() -> None:
    import subprocess
    import sys

    code = "import subquad, sys; print('subquad.distributed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert subquad.distributed is sd
