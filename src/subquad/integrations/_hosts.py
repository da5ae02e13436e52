"""What the host installers share: finding a host's folder, and writing or removing subquad's own.

``subquad install comfyui DIR`` and ``subquad install a1111 DIR`` write a small folder of subquad's
own code into the host (a ComfyUI custom node, an A1111 extension); the host imports subquad from
it at run time. Nothing of the hosts' code is copied (ComfyUI is GPL-3.0, A1111 AGPL-3.0).

A folder written here holds :data:`MARKER`: ``uninstall`` removes a folder only if it has it, so a
user's own folder of the same name is never deleted, and ``install`` twice rewrites the same files.

The integrations and the CLI may use :func:`find_host`, :func:`write_folder`, :func:`remove_folder`,
:class:`HostNotFound` and :data:`MARKER`; :data:`REQUIREMENT` and :func:`pip_install` (the one
install line every host message gives). The CLI imports this module where torch may be missing
(``subquad --version``, ``--help``): it imports nothing of subquad's but the face's torch-free
names. A host's memory budget settings are ``_host_budget``'s.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Dict, Optional, Sequence

from subquad import ArgumentError, __version__

MARKER = ".subquad-installed"
"""The file that marks a folder as written by ``subquad install`` (it holds subquad's version)."""

REQUIREMENT = "subquad"
"""What a host's Python installs: subquad without the ``torch`` extra. The host has its own torch
build (CUDA, ROCm, MPS, CPU); the extra could make pip fetch another one beside it."""


def pip_install(python: str) -> str:
    """The install line every host message gives (the CLI, the ComfyUI node, the A1111 extension):
    ``{python} -m pip install subquad``."""
    return f"{python} -m pip install {REQUIREMENT}"


class HostNotFound(ArgumentError):
    """The folder given to ``subquad install`` is not the host's (its message names what was looked for)."""


def find_host(root: "str | Path", host: str, markers: Sequence[str]) -> Path:
    """``root`` resolved, if it holds every path of ``markers``; else :class:`HostNotFound`."""
    path = Path(root).expanduser()
    if not path.is_dir():
        raise HostNotFound(f"{path} is not a folder; pass the folder {host} is installed in.")
    missing = [m for m in markers if not (path / m).exists()]
    if missing:
        raise HostNotFound(
            f"{path} does not look like {host}: it has no {', '.join(missing)} (looked for {', '.join(markers)})."
        )
    return path.resolve()


def write_folder(dest: Path, files: Dict[str, str]) -> Path:
    """Write ``files`` (relative path -> text) into ``dest`` with the marker; the same result
    however often it runs. Refuses a ``dest`` that exists without the marker (not ours)."""
    if dest.exists() and not (dest / MARKER).exists():
        raise HostNotFound(
            f"{dest} exists and was not written by subquad install (no {MARKER}); move it away or remove it first."
        )
    dest.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    (dest / MARKER).write_text(f"subquad {__version__}\n", encoding="utf-8")
    return dest


def remove_folder(dest: Path) -> Optional[Path]:
    """Remove ``dest`` if subquad wrote it; ``None`` if there was nothing of subquad's to remove."""
    if not dest.exists():
        return None
    if not (dest / MARKER).exists():
        raise HostNotFound(f"{dest} was not written by subquad install (no {MARKER}); not removing it.")
    shutil.rmtree(dest)
    return dest
