"""``subquad install comfyui DIR``: the custom node folder, written and removed.

The folder holds one ``__init__.py`` that imports the nodes from the subquad package (nothing of
ComfyUI's, nothing else of subquad's). The rest of the package may use :func:`install`,
:func:`uninstall`, ``MARKERS`` and ``FOLDER``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .._hosts import find_host, pip_install, remove_folder, write_folder

MARKERS = ("main.py", "nodes.py", "comfy/model_management.py", "custom_nodes")
"""What makes a folder a ComfyUI checkout for :func:`install`."""

FOLDER = "subquad"
"""The custom node folder :func:`install` writes into ``custom_nodes/``."""

_NODE_INIT = '''\
"""subquad for ComfyUI: exact attention in bounded memory.

Written by `subquad install comfyui`; `subquad uninstall comfyui <ComfyUI folder>` removes it.
The nodes are subquad's own code (subquad.integrations.comfyui), imported from the subquad
package installed in the Python that runs ComfyUI. Set SUBQUAD_COMFYUI_DEFAULT=1 before starting
ComfyUI to make subquad the attention of every model; SUBQUAD_MEMORY_BUDGET=512MiB sets the budget.
"""

import sys

try:
    from subquad.integrations import comfyui as _subquad_comfyui
except ImportError as error:
    raise ImportError(
        f"subquad is not importable in the Python that runs ComfyUI ({{sys.executable}}): {{error}}. "
        f"Install it there: {install}"
    ) from error

NODE_CLASS_MAPPINGS = _subquad_comfyui.NODE_CLASS_MAPPINGS
NODE_DISPLAY_NAME_MAPPINGS = _subquad_comfyui.NODE_DISPLAY_NAME_MAPPINGS

_subquad_comfyui.register()
'''


def install(root: "str | Path") -> Path:
    """Write the custom node folder ``root/custom_nodes/subquad`` (idempotent); returns its path.

    Raises:
        HostNotFound: ``root`` is not a ComfyUI folder, or ``custom_nodes/subquad`` exists and is not ours.
    """
    host = find_host(root, "ComfyUI", MARKERS)
    node_init = _NODE_INIT.format(install=pip_install("{sys.executable}"))  # the f-string's, in the node
    return write_folder(host / "custom_nodes" / FOLDER, {"__init__.py": node_init})


def uninstall(root: "str | Path") -> Optional[Path]:
    """Remove what :func:`install` wrote; the removed path, or ``None`` if there was nothing.

    Raises:
        HostNotFound: ``root`` is not a ComfyUI folder, or the folder there is not ours.
    """
    host = find_host(root, "ComfyUI", MARKERS)
    return remove_folder(host / "custom_nodes" / FOLDER)
