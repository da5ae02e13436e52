"""subquad's optional native tile kernels: one pass per row where eager PyTorch makes several
over each tile.

A bfloat16 tile of the ``matmul`` backend (a CPU with AVX512-BF16 or AMX) goes through six
elementwise passes in eager PyTorch in the forward (a conversion to float32, the rows' maximum, a
subtraction, ``exp2``, the row sums and a cast back) and ten in the backward, each streaming the
whole tile through the shared cache. ``_native_tiles.cpp`` does that work row by row, each row
held in the core's own cache; two more functions do a forward tile's per-row bookkeeping (the
rows whose offsets moved far and the next offsets; the running maximum, sum and accumulator),
where eager PyTorch makes about twenty small calls of 5-15 us each. Built for a CPU with
AVX512-BF16, it also runs the whole forward and backward loops (:mod:`subquad._backends.segments`)
for calls with no ``score_mod``, ``mask_mod`` or dropout; built for AVX512F or for AVX2 with FMA,
the same loops for float32 and float16 calls; the loops multiply on their own micro-kernels or
on ATen's (oneDNN's brgemm), as the calibration chose (:data:`ON_LOAD`). It is C++ that PyTorch's
extension builder compiles on this machine (a C++ compiler and ``ninja`` are needed, as for
``torch.compile`` on a CPU), 35-45 s once on a 2-core VM; the build is cached per source, torch
version, Python and CPU.

``SUBQUAD_NATIVE_FLAGS`` adds compiler flags to the build (part of the cache key), for example
``-mno-avx512f`` for the AVX2 build on a CPU with AVX512.

``SUBQUAD_NATIVE`` decides when it is used:

- ``auto`` (the default): when it is already built (``subquad build``, or :func:`build`);
- ``build``: built on the first call that needs it, if not built yet;
- ``off``: never.

Without it, or where it does not build (no compiler, Windows, macOS's compiler without OpenMP),
the eager passes run; the two differ by the rounding of the bfloat16 results (one unit in the last place).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Callable, Dict, List, Optional

import torch

from . import _settings as settings

_SOURCE = Path(__file__).with_name("_native_tiles.cpp")
_MODES = ("auto", "build", "off")
_LOCK = threading.Lock()
_LOADED: Dict[str, Optional[ModuleType]] = {}  # "module": the kernel or None, once decided
ON_LOAD: List[Callable[[ModuleType], None]] = []
"""Called with the kernel once it is loaded (the calibration sets which products its loops run)."""


def _flags() -> List[str]:
    flags = ["-O3", "-fopenmp"]
    if platform.machine() in ("x86_64", "AMD64"):
        flags.append("-march=native")  # the build is this CPU's: the cache key holds its flags
    return flags + (settings.text("SUBQUAD_NATIVE_FLAGS") or "").split()


@functools.lru_cache(maxsize=1)
def _cpu_signature() -> str:
    """This CPU's model and feature flags (a build for ``-march=native`` runs only on its like)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(sorted(set(keep)))


def build_name() -> str:
    """The build's name: a hash of the source, torch, Python, the flags and the CPU."""
    return _hashed_name(str(torch.__version__), " ".join(_flags()))


@functools.lru_cache(maxsize=16)
def _hashed_name(torch_version: str, flags: str) -> str:
    key = "\n".join([_SOURCE.read_text(), torch_version, sys.version, flags, _cpu_signature()])
    return "subquad_tiles_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def build_directory() -> Path:
    """Where builds are kept: ``$SUBQUAD_NATIVE_DIR``, else ``$XDG_CACHE_HOME/subquad/native``
    (``~/.cache/subquad/native``)."""
    root = settings.text("SUBQUAD_NATIVE_DIR")
    if root:
        return Path(root)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "subquad" / "native"


def _library() -> Path:
    name = build_name()
    return build_directory() / name / f"{name}.so"


def _import(path: Path) -> ModuleType:
    name = path.stem
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def build(verbose: bool = False) -> ModuleType:
    """Compile the kernel for this machine (or load the cached build) and return it.

    Raises whatever PyTorch's extension builder raises where it cannot (no compiler, no ninja).
    """
    with _LOCK:
        path = _library()
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            _compile(path, verbose)
        return _import(path)


_COMPILE = (
    "import sys; from torch.utils import cpp_extension; "
    "cpp_extension.load(name=sys.argv[1], sources=[sys.argv[2]], extra_cflags=sys.argv[3].split(), "
    "extra_ldflags=['-fopenmp'], build_directory=sys.argv[4], verbose=sys.argv[5] == '1')"
)


def _compile(path: Path, verbose: bool) -> None:
    """PyTorch's extension builder, in a child process: in this one it would name a second build of
    the same name (another folder, an earlier failure) ``<name>_v1``, which no later process finds."""
    args = [path.stem, str(_SOURCE), " ".join(_flags()), str(path.parent), "1" if verbose else "0"]
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE, *args], stdin=subprocess.DEVNULL, capture_output=not verbose, text=True
    )
    if proc.returncode != 0 or not path.exists():
        said = (proc.stderr or proc.stdout or "").strip().splitlines()
        raise RuntimeError(said[-1] if said else f"the builder ended with status {proc.returncode}")


BACKGROUND_LOG = "background-build.log"


def compiler_found() -> bool:
    """Whether a C++ compiler is on the PATH (``$CXX``, else ``c++``), as the builder needs."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


def build_in_background() -> bool:
    """Start ``python -m subquad build`` in a child process of low priority where the kernel is not
    built, ``SUBQUAD_NATIVE`` is not ``off`` and a C++ compiler is found (what a host's node or
    extension does when the host starts): the build runs once beside the host, and the processes
    after it use the kernel. Its output goes to ``background-build.log`` in
    :func:`build_directory`. Returns whether a build was started."""
    try:
        if mode() == "off" or _library().exists() or not compiler_found():
            return False
    except ValueError:  # a SUBQUAD_NATIVE the host's user mistyped: the calls will say so
        return False
    folder = build_directory()
    marker = folder / f"{build_name()}.building"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if marker.exists() and time.time() - marker.stat().st_mtime < 900:
            return False  # another process started it a moment ago
        marker.write_text(str(os.getpid()))
        with open(folder / BACKGROUND_LOG, "w") as log:
            subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    "import os, sys; os.nice(10); from subquad._cli import main; sys.exit(main(['build']))",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    except OSError:  # a read-only cache, no process to start: the eager passes run
        return False
    return True


def mode() -> str:
    """``SUBQUAD_NATIVE``: ``auto`` (default), ``build`` or ``off``."""
    return settings.choice("SUBQUAD_NATIVE", _MODES)


def tile_kernel() -> Optional[ModuleType]:
    """The kernel if it is to be used (see the module's docstring), else ``None``; decided once per
    process (a failed build warns once)."""
    if "module" in _LOADED:
        return _LOADED["module"]
    how = mode()
    module: Optional[ModuleType] = None
    if how != "off":
        try:
            if _library().exists():
                module = _import(_library())
            elif how == "build":
                module = build()
        except Exception as e:  # a failed build or load leaves the eager passes, said once
            warnings.warn(f"subquad: the native tile kernel is not used ({type(e).__name__}: {e})", stacklevel=2)
            module = None
    _LOADED["module"] = module
    if module is not None:
        for hook in ON_LOAD:
            try:
                hook(module)
            except Exception as e:  # the kernel runs as built
                warnings.warn(f"subquad: setting up the native kernel: {type(e).__name__}: {e}", stacklevel=2)
    return module


def status() -> str:
    """One line for ``subquad info``: whether the kernel is built and used, and with the loops."""
    try:
        how = mode()
    except ValueError as e:
        return str(e)
    built = _library().exists()
    where = str(_library())
    if how == "off":
        return f"off (SUBQUAD_NATIVE=off){'; built at ' + where if built else ''}"
    if built:
        module = tile_kernel()
        if module is None:  # built, but it did not load (tile_kernel warned why)
            return f"built, not loaded ({where})"
        if hasattr(module, "backward_segment_bf16"):
            loops = "with the forward and backward loops"
        elif hasattr(module, "forward_segment_bf16"):
            loops = "with the forward loop"
        elif hasattr(module, "forward_segment_f32"):
            loops = "with the float32 and float16 loops (no AVX512-BF16 at build time)"
        else:
            loops = "without the loops (neither AVX512F nor AVX2 with FMA at build time)"
        return f"built, used, {loops} ({where})"
    if how == "build":
        return "not built yet: the first call that uses it builds it (SUBQUAD_NATIVE=build)"
    return "not built (run `subquad build`; the eager passes run meanwhile)"
