"""subquad.integrations.comfyui against ComfyUI's real code (the v0.3.64 snapshot in shared/hosts).

The snapshot is found through ``SUBQUAD_HOSTS_DIR``, else ``<repo>/../shared/hosts``, and
extracted to a temporary folder; without it the tests skip, and so do the cases when a package of
``.ci/host-requirements.txt`` is missing (the reason names it). ComfyUI mutates global state when
imported, so every check that imports it runs in one child process (tests/_comfyui_cases.py, one
JSON line per case; tests/_host_snapshots.py runs it) and each case is a test here:

- the attention function vs ComfyUI's ``attention_pytorch`` and a float64 golden, in every layout,
  mask kind and skip flag; fp16 scores that overflow; extra keywords; the budget's three sources;
- ``"subquad"`` in ComfyUI's attention registry;
- the MODEL node loaded by ComfyUI's ``nodes.load_custom_node`` from the folder ``install`` wrote:
  one ``common_ksampler`` step of a tiny SD1.5-config UNet equals ComfyUI's default closely, every
  attention call went through ``subquad.sdpa`` and none through ComfyUI's sub-quad, the original
  model is untouched; the replace-patch path of hosts without the override hook; the message of a
  host without hooks; a ``memory_budget`` that is not a size, as ComfyUI's error dialog shows it
  (``subquad.ArgumentError: memory_budget: ...``);
- the VAE node on a tiny ``AutoencoderKL``; default mode and its undo.

Installing, the refusals and the import isolation need no ComfyUI import and run here.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

import subquad
from _host_snapshots import case_names, check_case, extract_root, fake_host, imported_modules, run_worker, snapshots
from subquad.integrations import comfyui
from subquad.integrations._hosts import MARKER, HostNotFound

WORKER = pathlib.Path(__file__).with_name("_comfyui_cases.py")
SNAPSHOT = "ComfyUI-a125cd84.tar.gz"


@pytest.fixture(scope="module")
def comfyui_root(tmp_path_factory):
    return extract_root(snapshots(SNAPSHOT) / SNAPSHOT, tmp_path_factory.mktemp("comfyui"))


@pytest.fixture(scope="module")
def results(comfyui_root):
    return run_worker(WORKER, comfyui_root, drop_env=(comfyui.ENV_DEFAULT, comfyui.ENV_BUDGET))


@pytest.mark.parametrize("name", case_names(WORKER))
def test_comfyui(results, name):
    check_case(results, name)


def test_install_is_idempotent_and_uninstall_removes_it(comfyui_root):
    path = comfyui.install(comfyui_root)
    assert path == comfyui_root.resolve() / "custom_nodes" / "subquad"
    text = (path / "__init__.py").read_text()
    assert comfyui.install(comfyui_root) == path
    assert (path / "__init__.py").read_text() == text and (path / MARKER).is_file()
    assert sorted(p.name for p in path.iterdir()) == sorted(["__init__.py", MARKER])
    # subquad's own code only: the node folder imports the package and defines nothing of ComfyUI's
    imported = imported_modules(text)
    assert imported == {"sys", "subquad.integrations"}, imported
    assert comfyui.uninstall(comfyui_root) == path and not path.exists()
    assert comfyui.uninstall(comfyui_root) is None
    assert (comfyui_root / "custom_nodes").is_dir()
    comfyui.install(comfyui_root)  # leave the tree as the worker may expect it


def test_install_refuses_a_folder_that_is_not_comfyui(tmp_path):
    (tmp_path / "main.py").write_text("")
    with pytest.raises(HostNotFound, match=r"does not look like ComfyUI.*nodes\.py.*main\.py"):
        comfyui.install(tmp_path)
    with pytest.raises(HostNotFound, match="does not look like ComfyUI"):
        comfyui.uninstall(tmp_path)
    with pytest.raises(HostNotFound, match="is not a folder"):
        comfyui.install(tmp_path / "missing")
    assert not (tmp_path / "custom_nodes").exists()


def test_install_leaves_a_users_own_folder_alone(tmp_path):
    fake_host(tmp_path, comfyui.MARKERS)
    own = tmp_path / "custom_nodes" / "subquad"
    own.mkdir()
    (own / "__init__.py").write_text("# the user's\n")
    with pytest.raises(HostNotFound, match="was not written by subquad install"):
        comfyui.install(tmp_path)
    with pytest.raises(HostNotFound, match="not removing it"):
        comfyui.uninstall(tmp_path)
    assert (own / "__init__.py").read_text() == "# the user's\n"


def test_import_needs_no_comfyui():
    code = (
        "import sys, subquad\n"
        "assert 'subquad.integrations.comfyui' not in sys.modules, 'import subquad imported the ComfyUI wing'\n"
        "import subquad.integrations.comfyui as c\n"
        "assert not [m for m in sys.modules if m == 'comfy' or m.startswith('comfy.')], 'it imported ComfyUI'\n"
        "assert 'comfyui' in subquad.integrations.__all__ and subquad.integrations.comfyui is c\n"
        "assert set(c.NODE_CLASS_MAPPINGS) == set(c.NODE_DISPLAY_NAME_MAPPINGS)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


def test_hooks_outside_comfyui_say_so():
    if "comfy" in sys.modules:  # pragma: no cover - only if some other test imported ComfyUI here
        pytest.skip("ComfyUI is importable in this process")
    with pytest.raises(ImportError, match="runs inside ComfyUI"):
        comfyui.hooks()


@pytest.mark.parametrize("node", [comfyui.SubquadModelAttention, comfyui.SubquadVAEAttention], ids=lambda n: n.__name__)
def test_a_bad_budget_is_refused_before_the_node_touches_comfyui(node):
    # the refusal needs no ComfyUI (the worker's model_node checks it inside ComfyUI's own dialog)
    with pytest.raises(subquad.ArgumentError) as refused:
        node().patch(None, " lots ")
    assert str(refused.value) == (
        "memory_budget: expected bytes or a size like '512MiB' or '2GB', or nothing for the default; got 'lots'."
    )
    assert isinstance(refused.value, ValueError) and isinstance(refused.value, RuntimeError)
    assert f"{type(refused.value).__module__}.{type(refused.value).__qualname__}" == "subquad.ArgumentError"
