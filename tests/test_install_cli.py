"""``subquad install|uninstall comfyui|a1111 DIR``: the command around the hosts' installers.

Run against the hosts' real folders (the snapshots in shared/hosts, found as in
tests/test_hosts_comfyui.py; without them these tests skip): what the command prints, its exit
status, that it can run twice, and that a wrong folder gets one line and status 2, no traceback.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from _host_snapshots import extract_root, hosts_folder
from subquad._cli import main
from subquad.integrations._hosts import MARKER

SNAPSHOTS = {
    "comfyui": ("ComfyUI-a125cd84.tar.gz", "custom_nodes"),
    "a1111": ("stable-diffusion-webui-1937682a.tar.gz", "extensions"),
}


def _host_folder(tmp_path_factory, host):
    name = SNAPSHOTS[host][0]
    folder = hosts_folder(name)
    if folder is None:
        pytest.skip(f"no {host} snapshot ({name}); set SUBQUAD_HOSTS_DIR to the folder that holds it")
    return extract_root(folder / name, tmp_path_factory.mktemp(host))


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


def test_the_host_names_are_checked_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["install", "invokeai", "/tmp"])
    assert exit_.value.code == 2 and "invalid choice: 'invokeai'" in capsys.readouterr().err
