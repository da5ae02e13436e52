""" "Which attention? (subquad)" against ComfyUI's real code (the snapshot in shared/hosts), and
``subquad bench --host comfyui PATH`` end to end.

As tests/test_hosts_comfyui.py: the snapshot is extracted to a temporary folder, the checks that
import ComfyUI run in one child process (tests/_comfyui_which_cases.py, one JSON line per case),
and each case is a test here. The command line runs in its own child process on a second, untouched
extraction, with a torchvision stand-in on ``PYTHONPATH`` (the wheel on the index fails next to the
CPU build of torch), a tiny size and two rounds; its checks are on structure, never on which
candidate wins (tests/test_bench_host.py injects timings for that).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from _host_snapshots import case_names, check_case, extract_root, run_worker, snapshots
from subquad.integrations import comfyui

WORKER = pathlib.Path(__file__).with_name("_comfyui_which_cases.py")
SNAPSHOT = "ComfyUI-a125cd84.tar.gz"
CANDIDATES = ("pytorch", "sub_quad", "split", "subquad")  # what this ComfyUI offers on a CPU, and ours


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = extract_root(snapshots(SNAPSHOT) / SNAPSHOT, tmp_path_factory.mktemp("comfyui"))
    return run_worker(WORKER, root, drop_env=(comfyui.ENV_DEFAULT, comfyui.ENV_BUDGET))


@pytest.mark.parametrize("name", case_names(WORKER))
def test_comfyui_which(results, name):
    check_case(results, name)


def _stand_in(folder: pathlib.Path) -> str:
    package = folder / "torchvision"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("from . import transforms  # noqa: F401\n")
    (package / "transforms.py").write_text(
        "def __getattr__(name):\n    raise AttributeError(f'torchvision stand-in: no {name}')\n"
    )
    return str(folder)


def _files(root: pathlib.Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


def test_bench_host_comfyui_end_to_end(tmp_path):
    root = extract_root(snapshots(SNAPSHOT) / SNAPSHOT, tmp_path / "host")
    before = _files(root)
    env = {k: v for k, v in os.environ.items() if k not in (comfyui.ENV_DEFAULT, comfyui.ENV_BUDGET)}
    env["PYTHONPATH"] = os.pathsep.join([_stand_in(tmp_path / "stand-in"), env.get("PYTHONPATH", "")])
    out = tmp_path / "out"
    command = [sys.executable, "-m", "subquad", "bench", "--host", "comfyui", str(root), "--resolution", "64"]
    run = subprocess.run(
        [*command, "--rounds", "2", "--out", str(out)], capture_output=True, text=True, env=env, timeout=600
    )
    if run.returncode != 0 and "No module named" in run.stderr:
        pytest.skip(f"ComfyUI's code needs a package not installed here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "a small SD1.5-config UNet with random weights" in run.stdout + run.stderr
    table = (out / "which.txt").read_text()
    for name in CANDIDATES:
        assert f"\n  {name}" in table, table
    assert "recommended: " in table and "peak memory: " in table
    records = json.loads((out / "results.json").read_text())
    assert {r["impl"] for r in records} >= set(CANDIDATES)
    assert all(r["status"] == "ok" and r["rounds"] == 2 and r["peak_bytes"] is not None for r in records), records
    assert (out / "which.png").stat().st_size > 10_000 and (out / "time.png").is_file()
    assert _files(root) == before, "the ComfyUI folder was written to"
    again = subprocess.run(
        [*command, "--rounds", "2", "--compare", str(out / "results.json")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "compared with" in again.stdout
