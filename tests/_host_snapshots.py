"""The hosts' snapshots (shared/hosts): where they are, and extracting them for a test.

Found through ``SUBQUAD_HOSTS_DIR``, else ``<repo>/../shared/hosts``, else ``/work/shared/hosts``;
tests skip without them (tests/test_hosts_comfyui.py, test_hosts_a1111.py, test_install_cli.py).
"""

from __future__ import annotations

import os
import pathlib
import tarfile
from typing import Optional

REPO = pathlib.Path(__file__).resolve().parents[1]


def hosts_folder(*names: str) -> Optional[pathlib.Path]:
    """The first snapshot folder that holds every archive in ``names``, or ``None``."""
    for folder in (os.environ.get("SUBQUAD_HOSTS_DIR"), REPO.parent / "shared" / "hosts", "/work/shared/hosts"):
        if folder and all((pathlib.Path(folder) / name).is_file() for name in names):
            return pathlib.Path(folder)
    return None


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
