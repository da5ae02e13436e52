"""The ``subquad`` command: ``subquad info``, ``subquad bench``, ``subquad install``, ``subquad build`` and ``subquad --version``.

``--version`` and ``--help`` need no torch (JAX users have none); ``info`` and ``bench`` import it
when they run, and without it say what to install.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, NoReturn, Optional, cast

from subquad._budget import format_bytes, free_memory_bytes
from subquad._requires import require_torch
from subquad._version import __version__
from subquad.integrations._hosts import HostNotFound, pip_install


def _info(args: argparse.Namespace) -> int:
    import torch  # optional dependency (subquad[torch]), present: main() required it

    import subquad  # optional: the torch face, loaded in full once torch is there
    from subquad import _native  # optional: needs torch
    from subquad._backends import cpu_flash_unavailable_reason  # optional: needs torch
    from subquad._backends.products import describe_cpu  # optional: needs torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"subquad {subquad.__version__}, torch {torch.__version__}")
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{device.type} ({torch.get_num_threads()} threads)"
    )
    print(f"device: {name}; free memory ≈ {format_bytes(free_memory_bytes(device))}")
    why = cpu_flash_unavailable_reason()
    print(f"fused CPU flash kernel (per tile, with lse): {'available' if why is None else 'unavailable: ' + why}")
    print(f"native tile kernel: {_native.status()}")
    if device.type == "cpu":
        print(f"CPU: {describe_cpu()}")
        print_calibration()
    if device.type == "mps":
        print_mps_defects()
    if device.type == "cuda":
        from torch.backends import cuda as bc

        for n in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "cudnn_sdp_enabled", "math_sdp_enabled"):
            if hasattr(bc, n):
                print(f"SDPA {n.replace('_sdp_enabled', '')}: {'enabled' if getattr(bc, n)() else 'disabled'}")
    B, H, Lq, Lk, E = args.shape
    dtype = args.dtype
    q = torch.empty(B, H, Lq, E, dtype=dtype, device=device)
    k = torch.empty(B, H, Lk, E, dtype=dtype, device=device)
    print()
    plan = subquad.explain(q, k, k, is_causal=args.causal, memory_budget=args.budget)
    print(plan)
    if args.run:
        import time

        from subquad._time_model import synchronize  # optional: needs torch

        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(B, H, L, E, generator=g, dtype=dtype).to(device) for L in (Lq, Lk, Lk))
        # GPU work is queued: wait for the copies before the clock starts and for the call
        # before it stops (CUDA and MPS alike), or the time is the launch's.
        synchronize(device)
        t0 = time.perf_counter()
        out = cast(torch.Tensor, subquad.attention(q, k, v, is_causal=args.causal, memory_budget=args.budget))  # no lse
        synchronize(device)
        dt = time.perf_counter() - t0
        print(
            f"\nran {plan.backend}: {dt * 1e3:.1f} ms, output {tuple(out.shape)} {str(out.dtype).replace('torch.', '')}"
        )
    return 0


def print_calibration() -> None:
    """Whether the loops or torch's fused kernel run which calls here, as measured on this CPU."""
    from subquad import _native  # optional: needs torch
    from subquad._backends import calibration  # optional: needs torch

    if _native.tile_kernel() is None:
        print(
            "calibration: none (no native kernel here). `subquad build` builds it (a C++ compiler, about 40 s once); "
            "the first call it could take, or `subquad calibrate`, then measures whether its loops beat torch's "
            "kernel on this CPU"
        )
        return
    entries = calibration.table() if calibration.enabled() else {}
    if not calibration.enabled():
        print("calibration: off (SUBQUAD_CALIBRATE=0): the fallback thresholds decide")
    elif not entries:
        print("calibration: not measured yet (on the first call the loops could take, or `subquad calibrate`)")
    else:
        print(f"calibration (measured on this CPU; {calibration.path()}):")
    for key in sorted(entries):
        print(f"  {calibration.describe(entries[key])}")
    for which in calibration.PRODUCT_KINDS:
        loops = "float32 and float16" if which == "float32" else which
        print(f"  {loops} loops' products: {calibration.products_choice(which)[1]}")


def _calibrate(dtypes: Optional[str], inference: bool, training: bool) -> int:
    """``subquad calibrate``: measure the loops against the fused kernel again, here."""
    import torch  # optional dependency, present: main() required it

    from subquad import _native  # optional: needs torch
    from subquad._backends import calibration  # optional: needs torch

    kernel = _native.tile_kernel()
    if kernel is None:
        print("subquad calibrate: no native kernel here (`subquad build` builds it)", file=sys.stderr)
        return 1
    has = {
        torch.bfloat16: hasattr(kernel, "forward_segment_bf16"),
        torch.float32: hasattr(kernel, "forward_segment_f32"),
        torch.float16: hasattr(kernel, "forward_segment_f32"),
    }
    names = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    wanted = [names[d.strip()] for d in dtypes.split(",")] if dtypes else [d for d, ok in has.items() if ok]
    directions = [d for d, on in ((False, inference), (True, training)) if on] or [False, True]
    remeasured = set()
    for dtype in wanted:
        if not has[dtype]:
            print(f"subquad calibrate: this build has no {dtype} loops", file=sys.stderr)
            continue
        try:
            which = calibration.products_of(dtype)
            if which not in remeasured:  # first the loops' products, then the loops on them
                remeasured.add(which)
                products = calibration.calibrate_products(which)
                if products is not None:
                    print(calibration.describe_products(products))
            for grad in directions:
                print(calibration.describe(calibration.calibrate(dtype, grad)))
        except calibration.Unsettled as e:
            print(f"subquad calibrate: the rounds disagreed, the machine is busy ({e}); nothing kept", file=sys.stderr)
            return 1
    return 0


def print_mps_defects() -> None:
    """The known defects of this torch's SDPA on MPS that subquad routes around (docs/devices.md)."""
    import torch  # optional dependency, present: main() required it

    from subquad._backends import mps_sdpa  # optional: needs torch

    active = mps_sdpa.active_defects()
    print(f"torch {torch.__version__}'s SDPA on MPS: {len(active)} known defect(s) routed around")
    for d in active:
        print(f"  pytorch#{d.issue} ({d.releases}): {d.summary}; detour: {mps_sdpa.DETOURS[d.detour]}")


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line, ``subquad info: error: ...``, exit status 2 (as ``subquad bench``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _Parser(prog="subquad", description="Exact attention in bounded memory.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    p = info = sub.add_parser("info", help="device, available kernels, and the plan for a sample input")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument(
        "--shape",
        default="1,8,4096,64",
        metavar="B,H,Lq,Lk,E",
        help="the sample input's shape, as for subquad bench (B,H,L,E also works; default 1,8,4096,64)",
    )
    p.add_argument(
        "--dtype",
        default="fp32",
        metavar="{fp16,bf16,fp32,fp64}",
        help="the sample input's dtype (also float16/half, bfloat16, float32/float, float64/double; default fp32)",
    )
    p.add_argument("--budget", default=None, help="memory budget, e.g. 64MiB (default: half the free memory)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--run", action="store_true", help="also run the sample input and time it")
    sub.add_parser(
        "build",
        help="compile the optional native kernel for bfloat16 tiles on this CPU (a C++ compiler; about 30 s)",
        description="Compile subquad's native kernel for the bfloat16 tiles of the matmul backend on this "
        "machine (PyTorch's extension builder: a C++ compiler and ninja), or find it built. With "
        "SUBQUAD_NATIVE=auto (the default) the tiles use it once it is built; SUBQUAD_NATIVE=off never does.",
    )
    p = sub.add_parser(
        "calibrate",
        help="measure here whether the native kernel's loops beat torch's fused kernel (about 1-3 s a dtype)",
        description="Time the native kernel's loops against torch's fused kernel on a few representative "
        "calls, in interleaved rounds, and keep the result beside the build: `auto` takes the loops only where "
        "they won by 5%%. Runs by itself on the first call that needs it; SUBQUAD_CALIBRATE=0 turns it off.",
    )
    p.add_argument(
        "--dtype", default=None, help="fp32, bf16, fp16, comma-separated (default: every dtype the build has)"
    )
    p.add_argument("--inference", action="store_true", help="only inference (default: inference and training)")
    p.add_argument("--training", action="store_true", help="only training (forward + backward)")
    sub.add_parser("bench", help="benchmark attention implementations on this machine (see `subquad bench --help`)")
    for verb, what in (("install", "write"), ("uninstall", "remove")):
        p = sub.add_parser(
            verb,
            help=f"{what} subquad's ComfyUI custom node or AUTOMATIC1111 extension (docs/hosts.md)",
            description=f"{what.capitalize()} subquad's custom node (ComfyUI: DIR/custom_nodes/subquad) or "
            "extension (AUTOMATIC1111: DIR/extensions/subquad). The host's own Python must have subquad "
            "installed: the node and the extension import it when the host starts.",
        )
        p.add_argument("host", choices=HOSTS, help="the application")
        p.add_argument("dir", help="the folder the application is installed in")
    # `subquad bench` parses its own arguments; --version and --help end in parse_args, without torch.
    args = None if argv[:1] == ["bench"] else parser.parse_args(argv or ["info"])
    try:
        require_torch()
    except ModuleNotFoundError as e:
        parser.exit(1, f"{e}\n")
    if args is None:
        from subquad.bench.cli import main as bench_main  # optional: needs torch, required above

        return int(bench_main(argv[1:]) or 0)
    if args.command == "info":
        # The spellings of subquad bench, which needs torch: required above.
        from subquad.bench.cases import DTYPES, parse_dtype, parse_shape  # optional: needs torch

        try:
            args.shape, args.dtype = parse_shape(args.shape), DTYPES[parse_dtype(args.dtype)]
        except ValueError as e:
            info.error(str(e))
        return _info(args)
    if args.command in ("install", "uninstall"):
        return _install(args.command, args.host, args.dir)
    if args.command == "build":
        return _build()
    if args.command == "calibrate":
        if args.dtype and any(d.strip() not in ("fp32", "bf16", "fp16") for d in args.dtype.split(",")):
            parser.exit(2, f"subquad calibrate: error: --dtype {args.dtype}: expected fp32, bf16, fp16\n")
        return _calibrate(args.dtype, args.inference, args.training)
    return 0


def _build() -> int:
    """``subquad build``: 0 when the kernel is built (or was), 1 with the builder's reason when not."""
    from subquad import _native  # optional: needs torch, required by main()

    try:
        _native.build(verbose=False)
    except Exception as e:  # the builder's errors (no compiler, no ninja, a compile error), in one place
        print(f"subquad build: the native kernel did not build: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"native tile kernel: {_native.status()}")
    return 0


HOSTS = ("comfyui", "a1111")


def _install(verb: str, host: str, folder: str) -> int:
    """``subquad install|uninstall HOST DIR``: 0 when done, 2 (one line, no traceback) when DIR is not HOST."""
    module = importlib.import_module(f"subquad.integrations.{host}")  # optional: needs torch, present
    name = {"comfyui": "ComfyUI", "a1111": "AUTOMATIC1111"}[host]
    try:
        done = module.install(folder) if verb == "install" else module.uninstall(folder)
    except HostNotFound as e:
        print(f"subquad {verb}: {e}", file=sys.stderr)
        return 2
    if verb == "uninstall":
        print(f"removed {done}" if done is not None else f"nothing to remove: subquad is not installed in {folder}")
        return 0
    print(f"installed subquad {__version__} for {name} in {done}")
    _build_for_host()
    python = _host_python(folder) or "<the Python that runs it>"
    print(f"{name} imports subquad when it starts; if its Python does not have it: {pip_install(python)}")
    print(f"undo: subquad uninstall {host} {folder}")
    return 0


def _build_for_host() -> None:
    """``subquad install``: build the native kernel for this CPU now, unless ``SUBQUAD_NATIVE=off``
    or it is built; a failure is said, never fatal (the host runs without the loops)."""
    from subquad import _native  # optional: needs torch, required by main()

    try:
        if _native.mode() == "off":
            print("native kernel: not built (SUBQUAD_NATIVE=off)")
            return
        if not _native.compiler_found():
            print("native kernel: not built (no C++ compiler found); the host runs torch's kernel and the eager tiles")
            return
        print("building subquad's native kernel for this CPU (once, about 40 s; SUBQUAD_NATIVE=off skips it) ...")
        _native.build()
    except Exception as e:  # the builder's errors, and a mistyped SUBQUAD_NATIVE: said, never fatal
        print(f"native kernel: not built ({type(e).__name__}: {str(e)[:300]})")
        return
    print(f"native kernel: {_native.status()}")


def _host_python(folder: str) -> Optional[str]:
    """The Python a host folder runs with, where it keeps its own (A1111's venv, ComfyUI portable's)."""
    from pathlib import Path

    root = Path(folder).resolve()
    for candidate in (
        root / "venv" / "bin" / "python",
        root / ".venv" / "bin" / "python",
        root / "venv" / "Scripts" / "python.exe",
        root.parent / "python_embeded" / "python.exe",
    ):
        if candidate.exists():
            return str(candidate)
    return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
