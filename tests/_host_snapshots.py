"""What the host tests share: the snapshots, the worker processes that import a host, fake host folders.

The snapshots (shared/hosts) are found through ``SUBQUAD_HOSTS_DIR``, else ``<repo>/../shared/hosts``;
without them the tests skip (tests/test_hosts_comfyui.py, test_hosts_a1111.py, test_install_cli.py).

A host mutates global state when imported, so each host's checks run in one child process, a
*worker* (tests/_comfyui_cases.py, tests/_a1111_cases.py), and each of its cases is a test:

- in the worker, :class:`Worker` registers the cases (``@case``), imports the host inside
  :meth:`Worker.imports` and runs the cases with :meth:`Worker.main`, one JSON line each:
  ``{"case", "ok", "detail", "seconds"}``. A third-party package the host's code needs and this
  Python lacks (``.ci/host-requirements.txt``) gives ``{"skip": reason}`` instead, for every case
  when the host's import needs it, or ``{"case", "skip"}`` when only one case does;
- in pytest, :func:`case_names` lists the worker's cases for ``parametrize``, :func:`run_worker`
  runs it once, and :func:`check_case` passes, skips or fails one case from its line.

A missing module that is the host's own or subquad's is a failure, never a skip.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

if TYPE_CHECKING:
    from torch import Tensor

REPO = pathlib.Path(__file__).resolve().parents[1]
REQUIREMENTS = ".ci/host-requirements.txt"
"""The hosts' own dependencies (relative to the repository), installed by CI after subquad[dev]."""

Results = Tuple[Dict[str, Dict[str, Any]], str]
"""What :func:`run_worker` gives: the worker's line per case, and the end of its stderr."""


# ---------------------------------------------------------------------------------------------
# The snapshots


def hosts_folder(*names: str) -> Optional[pathlib.Path]:
    """The first snapshot folder that holds every archive in ``names``, or ``None``."""
    for folder in (os.environ.get("SUBQUAD_HOSTS_DIR"), REPO.parent / "shared" / "hosts"):
        if folder and all((pathlib.Path(folder) / name).is_file() for name in names):
            return pathlib.Path(folder)
    return None


def snapshots(*names: str) -> pathlib.Path:
    """The folder that holds every archive in ``names``; else the calling test skips, naming them."""
    folder = hosts_folder(*names)
    if folder is None:
        import pytest  # the pytest side only: the workers import this module too

        pytest.skip(
            f"no host snapshot {', '.join(names)} in SUBQUAD_HOSTS_DIR or <repo>/../shared/hosts; "
            "set SUBQUAD_HOSTS_DIR to the folder that holds it"
        )
    return folder


def extract(archive: pathlib.Path, dest: pathlib.Path, strip: bool = False) -> None:
    """Unpack ``archive`` into ``dest``; ``strip`` drops the archive's top folder."""
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        if strip:
            for member in members:
                member.name = member.name.partition("/")[2]
            members = [m for m in members if m.name]
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:  # pragma: no cover - Python < 3.11.4
            tar.extractall(dest, members=members)


def extract_root(archive: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """Unpack ``archive`` into ``dest`` and return its one top folder (the host's root)."""
    extract(archive, dest)
    (root,) = [p for p in dest.iterdir() if p.is_dir()]
    return root


def fake_host(root: pathlib.Path, markers: Iterable[str]) -> pathlib.Path:
    """``root`` with an empty file for each marker that has a suffix and a folder for each other one:
    what the installers look for, without the host."""
    for marker in markers:
        target = root / marker
        if target.suffix:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("")
        else:
            target.mkdir(parents=True, exist_ok=True)
    return root


def imported_modules(source: str) -> set:
    """The modules ``source`` imports (``import a`` and ``from a import b`` give ``a``)."""
    tree = ast.parse(source)
    return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }


# ---------------------------------------------------------------------------------------------
# The pytest side of a worker


def case_names(worker: pathlib.Path) -> List[str]:
    """The worker's cases (its functions decorated ``@case``), read without running it."""
    return [
        node.name
        for node in ast.parse(worker.read_text()).body
        if isinstance(node, ast.FunctionDef) and any(getattr(d, "id", None) == "case" for d in node.decorator_list)
    ]


def run_worker(worker: pathlib.Path, root: pathlib.Path, drop_env: Iterable[str] = ()) -> Results:
    """Run ``python worker root`` once (without the variables ``drop_env``) and read its lines.

    Skips the calling fixture when the worker could not import the host for a missing package.
    """
    env = {k: v for k, v in os.environ.items() if k not in set(drop_env)}
    run = subprocess.run(
        [sys.executable, str(worker), str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,  # the cases take about 30 s on 2 cores: only a hang gets near this
    )
    found = {}
    for line in run.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            if "case" not in row:
                import pytest  # the pytest side only

                pytest.skip(row["skip"])
            found[row["case"]] = row
    return found, run.stderr[-3000:]


def check_case(results: Results, name: str) -> None:
    """Pass, skip (a package the case needs is missing) or fail the worker's case ``name``."""
    import pytest  # the pytest side only

    found, stderr = results
    assert name in found, f"the worker reported nothing for {name}; its stderr:\n{stderr}"
    if "skip" in found[name]:
        pytest.skip(found[name]["skip"])
    assert found[name]["ok"], found[name]["detail"]


# ---------------------------------------------------------------------------------------------
# The worker's side


class Worker:
    """The cases of one host, run in this process, reported one JSON line each.

    ``host`` names the application in skip reasons; ``root`` is its extracted folder; ``own`` its
    top-level packages (with whatever ``root`` holds on ``sys.path``: a module missing among them
    fails, it is no dependency). Whatever the host prints goes to stderr: stdout keeps only the
    JSON lines.
    """

    def __init__(self, host: str, root: str, own: Iterable[str] = ()) -> None:
        self.host, self.root, self.own = host, os.path.realpath(root), frozenset(own) | {"subquad", "torch"}
        self.cases: Dict[str, Callable[[], Any]] = {}
        self.out = os.fdopen(os.dup(1), "w")
        sys.stdout = sys.stderr

    def case(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        self.cases[fn.__name__] = fn
        return fn

    def missing_package(self, error: ModuleNotFoundError) -> Optional[str]:
        """Why to skip, if ``error`` is a third-party package missing here (not the host's own
        code, not subquad or torch); ``None`` for a failure."""
        top = (error.name or "").partition(".")[0]
        if not top or top in self.own or self._in_host(top):
            return None
        return f"{self.host}'s code needs {top}, not installed here (pip install -r {REQUIREMENTS})"

    def _in_host(self, top: str) -> bool:
        for entry in sys.path:
            folder = os.path.realpath(entry or os.curdir)
            inside = folder == self.root or folder.startswith(self.root + os.sep)
            if inside and (
                os.path.isdir(os.path.join(folder, top)) or os.path.isfile(os.path.join(folder, top + ".py"))
            ):
                return True
        return False

    @contextlib.contextmanager
    def imports(self) -> Iterator[None]:
        """Around the host's imports: a third-party package missing ends the worker with one skip line."""
        try:
            yield
        except ModuleNotFoundError as e:
            reason = self.missing_package(e)
            if reason is None:
                raise
            self._report({"skip": reason})
            sys.exit(0)

    def main(self, names: List[str]) -> None:
        """Run the cases ``names`` (all when empty), one line each."""
        for name in names or list(self.cases):
            start = time.perf_counter()
            row: Dict[str, Any] = {"case": name}
            try:
                row.update(ok=True, detail=self.cases[name]())
            except ModuleNotFoundError as e:
                reason = self.missing_package(e)
                row.update({"skip": reason} if reason else {"ok": False, "detail": traceback.format_exc()[-3000:]})
            except Exception:
                row.update(ok=False, detail=traceback.format_exc()[-3000:])
            row["seconds"] = round(time.perf_counter() - start, 2)
            self._report(row)

    def _report(self, row: Dict[str, Any]) -> None:
        print(json.dumps(row, default=str), file=self.out, flush=True)


def close(name: str, test: "Tensor", ref: "Tensor", golden: "Tensor", fudge: float, floor: float = 1e-6) -> str:
    """``err(test) <= fudge * err(ref) + floor``, both against the float64 ``golden``; else an
    AssertionError saying which tensor, where, and by how much. Returns the two errors."""
    assert test.shape == golden.shape, f"{name}: shape {tuple(test.shape)}, expected {tuple(golden.shape)}"
    assert bool(test.isfinite().all()), f"{name}: {int((~test.isfinite()).sum())} non-finite values in the output"
    err = (test.double() - golden).abs()
    worst, ref_err = err.max().item(), (ref.double() - golden).abs().max().item()
    if worst > fudge * ref_err + floor:
        at = tuple(int(i) for i in (err == worst).nonzero()[0])
        raise AssertionError(
            f"{name}: max error {worst:.3g} at {at}, the reference's {ref_err:.3g} (allowed {fudge} x that + {floor})"
        )
    return f"{name}: err {worst:.2g} (reference {ref_err:.2g})"
