"""subquad.jax beyond one device: ring and all-to-all attention under shard_map, and the mesh wrapper.

XLA's host device count is fixed when JAX is first imported, and this process has imported JAX
with one device already (tests/test_jax.py), so the checks run in one subprocess with four CPU
devices (tests/_jax_sharded_cases.py; P=2 on a sub-mesh), one JSON line per case, and each case
is a test here. Every case compares each device's output, lse and gradients with single-device
subquad.jax.attention on the whole sequence in float64.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("jax")

WORKER = pathlib.Path(__file__).with_name("_jax_sharded_cases.py")
CASES = [
    node.name
    for node in ast.parse(WORKER.read_text()).body
    if isinstance(node, ast.FunctionDef) and any(getattr(d, "id", None) == "case" for d in node.decorator_list)
]


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ)  # the worker imports the installed subquad (CI: the wheel), as the tests do
    env.pop("XLA_FLAGS", None)
    # Two workers share the cases and run at once (compiling is mostly single-threaded).
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), *CASES[i::2]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    found, stderr = {}, ""
    for worker in workers:
        out, err = worker.communicate(timeout=3600)  # an hour: only a hang gets near it
        stderr += err[-2000:]
        for line in out.splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                found[row["case"]] = row
    return found, stderr


@pytest.mark.parametrize("name", CASES)
def test_sharded(results, name):
    found, stderr = results
    assert name in found, f"the worker reported nothing for {name}; its stderr:\n{stderr}"
    assert found[name]["ok"], found[name]["detail"]
