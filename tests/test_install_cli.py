"""``subquad install|uninstall comfyui|a1111 DIR``: the command around the hosts' installers.

Run against the hosts' real folders (the snapshots in shared/hosts, found as in
tests/test_hosts_comfyui.py; without them these tests skip): what the command prints, its exit
status, that it can run twice, and that a wrong folder gets one line and status 2, no traceback.
None of this imports a host, so the hosts' own dependencies are not needed. One install line for
the hosts everywhere: the command, the node and extension it writes, and docs/hosts.md.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from _host_snapshots import REPO, extract_root, fake_host, snapshots
from subquad._cli import main
from subquad.integrations import a1111, comfyui
from subquad.integrations._hosts import MARKER, REQUIREMENT, pip_install

SNAPSHOTS = {
    "comfyui": ("ComfyUI-a125cd84.tar.gz", "custom_nodes"),
    "a1111": ("stable-diffusion-webui-1937682a.tar.gz", "extensions"),
}


def _host_folder(tmp_path_factory, host):
    name = SNAPSHOTS[host][0]
    return extract_root(snapshots(name) / name, tmp_path_factory.mktemp(host))


@pytest.mark.parametrize("host", list(SNAPSHOTS))
def test_install_twice_then_uninstall_twice(tmp_path_factory, capsys, host):
    root = _host_folder(tmp_path_factory, host)
    folder = root / SNAPSHOTS[host][1] / "subquad"
    assert main(["install", host, str(root)]) == 0
    first = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert (folder / MARKER).is_file() and len(first) >= 2
    out = capsys.readouterr().out
    assert f"in {folder}" in out and f"subquad uninstall {host} {root}" in out
    assert main(["install", host, str(root)]) == 0  # the same files again
    assert {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()} == first
    assert main(["uninstall", host, str(root)]) == 0
    assert not folder.exists() and f"removed {folder}" in capsys.readouterr().out
    assert main(["uninstall", host, str(root)]) == 0
    assert "nothing to remove" in capsys.readouterr().out


@pytest.mark.parametrize("host,name", [("comfyui", "ComfyUI"), ("a1111", "AUTOMATIC1111")])
def test_a_folder_that_is_not_the_host_gets_one_line_and_status_2(tmp_path, host, name):
    (tmp_path / "main.py").write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "subquad", "install", host, str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("subquad install: ") and name in line and "looked for" in line
    assert not any(tmp_path.rglob(MARKER)), "nothing may be written into a folder that is not the host"


def test_the_host_names_are_checked_by_the_parser(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["install", "invokeai", str(tmp_path)])
    assert exit_.value.code == 2 and "invalid choice: 'invokeai'" in capsys.readouterr().err


def test_one_install_line_for_the_hosts_everywhere(tmp_path, capsys):
    # subquad without the torch extra: the host's own torch build stays (the extra could fetch another)
    assert REQUIREMENT == "subquad" and pip_install("python") == "python -m pip install subquad"
    venv_python = (tmp_path / "a1111" / "venv" / "bin" / "python").resolve()  # the CLI names the host's own Python
    fake_host(tmp_path / "a1111", [*a1111.MARKERS, "venv/bin/python"])
    fake_host(tmp_path / "comfyui", comfyui.MARKERS)
    assert main(["install", "a1111", str(tmp_path / "a1111")]) == 0
    assert f"{pip_install(str(venv_python))}\n" in capsys.readouterr().out
    assert main(["install", "comfyui", str(tmp_path / "comfyui")]) == 0
    assert f"{pip_install('<the Python that runs it>')}\n" in capsys.readouterr().out
    extension = tmp_path / "a1111" / "extensions" / "subquad"
    assert pip_install("venv/bin/python") in (extension / "scripts" / "subquad_optimization.py").read_text()
    installer = (extension / "install.py").read_text()
    assert f'launch.is_installed("{REQUIREMENT}")' in installer and f'install \\"{REQUIREMENT}>=' in installer, (
        installer
    )
    node = (tmp_path / "comfyui" / "custom_nodes" / "subquad" / "__init__.py").read_text()
    assert pip_install("{sys.executable}") in node, node
    readme = (REPO / "README.md").read_text()
    for where, docs in {
        "docs/hosts.md": (REPO / "docs" / "hosts.md").read_text(),
        "README.md's hosts": readme[readme.index("## Inside ComfyUI and AUTOMATIC1111") :].split("\n## ")[0],
    }.items():
        installed = {spec.strip("\"'.") for spec in re.findall(r"pip install (?!-r )([\"']?[\w.\[\],]+)", docs)}
        assert installed == {REQUIREMENT}, f"{where}: {installed}"
