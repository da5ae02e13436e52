"""subquad.integrations.a1111 against AUTOMATIC1111's real code (the snapshots in shared/hosts).

The three snapshots (stable-diffusion-webui, Stability-AI's ``ldm`` and ``sgm``) are found through
``SUBQUAD_HOSTS_DIR``, else ``<repo>/../shared/hosts``, and extracted to a temporary folder laid out
as A1111's installer lays them out (``repositories/...``); without them the tests skip, and so do
the cases when a package of ``.ci/host-requirements.txt`` is missing (the reason names it).
Importing the web UI puts ``modules``, ``ldm`` and ``sgm`` into ``sys.modules`` and patches torch,
so every check that imports it runs in one child process (tests/_a1111_cases.py, one JSON line per
case; its docstring lists the stand-ins; tests/_host_snapshots.py runs it) and each case is a test
here:

- the extension folder that ``install`` wrote, loaded by A1111's own script loader, registers
  subquad through ``script_callbacks.on_list_optimizers``; A1111's ``sd_hijack.list_optimizers``
  lists it; "Automatic" (``sd_hijack.apply_optimizations``) never picks it on CPU, MPS or CUDA;
  choosing its title applies it; ``undo()`` restores A1111's defaults (identity);
- ``CrossAttention`` (self and cross, masks, sgm's extra keywords) and ``AttnBlock`` of the real
  ``ldm`` and ``sgm``: equal to the libraries' own forwards in float64, as close to the float64
  golden as they are in float32;
- a real A1111 ``Hypernetwork`` in ``shared.loaded_hypernetworks`` is applied as A1111's own
  forward applies it; ``opts.upcast_attn`` (fp16, bf16; fp16 products that overflow); the budget
  from the setting and from ``SUBQUAD_MEMORY_BUDGET`` reaches subquad; a setting that is not a
  size fails the generation with the message A1111 shows (the setting, what works, the value) and
  the public ``subquad.ArgumentError``.

Installing, the refusals and the import isolation need no A1111 import and run here.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from _host_snapshots import (
    case_names,
    check_case,
    extract,
    extract_root,
    fake_host,
    imported_modules,
    run_worker,
    snapshots,
)
from subquad.integrations import a1111
from subquad.integrations._hosts import MARKER, HostNotFound

WORKER = pathlib.Path(__file__).with_name("_a1111_cases.py")
WEBUI = "stable-diffusion-webui-1937682a.tar.gz"
LAYOUT = {  # archive -> where A1111's installer puts its top folder's contents, under the web UI
    "stablediffusion-cf1d67a6-ldm.tar.gz": "repositories/stable-diffusion-stability-ai",
    "generative-models-45c443b3-sgm.tar.gz": "repositories/generative-models",
}


@pytest.fixture(scope="module")
def webui_root(tmp_path_factory):
    folder = snapshots(WEBUI, *LAYOUT)
    root = extract_root(folder / WEBUI, tmp_path_factory.mktemp("a1111"))
    for archive, under in LAYOUT.items():
        (root / under).mkdir(parents=True)
        extract(folder / archive, root / under, strip=True)  # without the archive's top folder
    return root


@pytest.fixture(scope="module")
def results(webui_root):
    return run_worker(WORKER, webui_root, drop_env=(a1111.ENV_BUDGET, "COMMANDLINE_ARGS", "ATTN_PRECISION"))


@pytest.mark.parametrize("name", case_names(WORKER))
def test_a1111(results, name):
    check_case(results, name)


def test_install_is_idempotent_and_uninstall_removes_it(webui_root):
    a1111.uninstall(webui_root)  # the worker's, if it ran first in this process
    path = a1111.install(webui_root)
    assert path == webui_root.resolve() / "extensions" / "subquad"
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    assert files == sorted([MARKER, "install.py", "scripts/subquad_optimization.py"]), files
    texts = {name: (path / name).read_text() for name in files}
    assert a1111.install(webui_root) == path
    assert {name: (path / name).read_text() for name in files} == texts
    # subquad's own code only: the script imports A1111's callback module and subquad, nothing else
    imported = imported_modules(texts["scripts/subquad_optimization.py"])
    assert imported == {"modules", "subquad.integrations"}, imported
    assert a1111.TITLE in texts["scripts/subquad_optimization.py"]
    # run by the web UI at start: only its own launch helpers
    assert imported_modules(texts["install.py"]) == {"launch"}
    assert a1111.uninstall(webui_root) == path and not path.exists()
    assert a1111.uninstall(webui_root) is None
    assert (webui_root / "extensions").is_dir()


def test_install_creates_extensions_in_a_fresh_checkout(tmp_path):
    fake_host(tmp_path, a1111.MARKERS)
    assert a1111.install(tmp_path) == tmp_path.resolve() / "extensions" / "subquad"


def test_install_refuses_a_folder_that_is_not_a1111(tmp_path):
    (tmp_path / "webui.py").write_text("")
    with pytest.raises(HostNotFound, match="does not look like AUTOMATIC1111 stable-diffusion-webui") as refused:
        a1111.install(tmp_path)
    missing = "modules/script_callbacks.py, modules/sd_hijack_optimizations.py"
    assert f"no {missing}" in str(refused.value) and f"webui.py, {missing}" in str(refused.value), refused.value
    assert not (tmp_path / "extensions").exists()
    with pytest.raises(HostNotFound, match="is not a folder"):
        a1111.install(tmp_path / "webui.py")


def test_install_refuses_forge(tmp_path):
    fake_host(tmp_path, [*a1111.MARKERS, "backend/attention.py"])
    with pytest.raises(HostNotFound, match=r"is Stable Diffusion WebUI Forge \(it has backend/attention\.py\)"):
        a1111.install(tmp_path)
    assert not (tmp_path / "extensions").exists()


def test_install_refuses_a_folder_of_the_same_name_that_is_not_ours(tmp_path):
    fake_host(tmp_path, a1111.MARKERS)
    theirs = tmp_path / "extensions" / "subquad"
    theirs.mkdir(parents=True)
    (theirs / "keep.txt").write_text("a user's own extension")
    with pytest.raises(HostNotFound, match="was not written by subquad install"):
        a1111.install(tmp_path)
    with pytest.raises(HostNotFound, match="not removing it"):
        a1111.uninstall(tmp_path)
    assert (theirs / "keep.txt").read_text() == "a user's own extension"


def test_importing_subquad_does_not_import_the_host():
    code = (
        "import sys, subquad.integrations.a1111; "
        "print([m for m in sys.modules if m.split('.')[0] in ('modules', 'ldm', 'sgm', 'gradio', 'launch')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
    code = "import sys, subquad; print('subquad.integrations.a1111' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", out
