"""AUTOMATIC1111 on CPU: the attention blocks at SD1.5 sizes under sdp, sub-quadratic, Doggettx and subquad.

Issue 28's A1111 measurement, inside the web UI's real code (the snapshots in shared/hosts, laid
out as A1111's installer lays them out, or ``--webui DIR``), with random weights, fp32:

- ``ldm.modules.attention.SpatialTransformer`` as SD1.5 builds it (8 heads, conv in/out, one
  ``BasicTransformerBlock``: self-attention, cross-attention on a ``(B, 77, 768)`` context, feed
  forward) at a 64x64 latent (512 px), batch 2 (A1111 runs cond and uncond together): the
  320-channel blocks at 64x64 (4096 tokens), 640 at 32x32, 1280 at 16x16;
- the VAE's ``ldm.modules.diffusionmodules.model.AttnBlock`` (512 channels, one head) at 64x64 and
  128x128 (the decoder's mid-block at 512 and 1024 px), batch 1.

Each variant is chosen the way a user chooses it, by its title through A1111's own
``sd_hijack.apply_optimizations``: "sdp - scaled dot product", "sub-quadratic", "Doggettx", and
subquad from the extension ``subquad install a1111`` writes (budget: subquad's default, half the
free memory; ``subquad-256MiB`` sets the setting "subquad memory budget").

Every run is a fresh Python process started with ``MALLOC_MMAP_THRESHOLD_=131072`` (freed tensors
go back to the OS): it starts the web UI's modules (the stand-ins of tests/_a1111_cases.py: none
on the attention path), builds the block, warms up on a 16x16 input, resets the RSS high-water mark
(``5`` into ``/proc/self/clear_refs``) and reports the time of one forward and ``VmHWM`` minus the
RSS before it ("peak growth": the call's working set and its output). Rounds are interleaved
(every variant once per round, the order rotated each round); the tables give the median and the
min-max spread. A run the kernel kills for memory is a result ("killed").

::

    python benchmarks/hosts_a1111.py                          # the full measurement -> docs/benchmarks/data/hosts/hosts-cpu/
    python benchmarks/hosts_a1111.py --quick --out /tmp/a1q   # tiny blocks, one round: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tarfile
import tempfile
import time
from typing import Any, Dict, List, Optional

from _harness import fmt_gib, machine, run_script_child, status_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WEBUI = "stable-diffusion-webui-1937682a.tar.gz"
LAYOUT = {
    "stablediffusion-cf1d67a6-ldm.tar.gz": "repositories/stable-diffusion-stability-ai",
    "generative-models-45c443b3-sgm.tar.gz": "repositories/generative-models",
}

VARIANTS = ("sdp", "sub-quadratic", "Doggettx", "subquad", "subquad-256MiB")
TITLES = {"sdp": "sdp - scaled dot product", "sub-quadratic": "sub-quadratic", "Doggettx": "Doggettx"}

# (name, kind, channels, side, batch): SD1.5 at 512 px
BLOCKS = [
    ("SpatialTransformer 320ch 64x64", "transformer", 320, 64, 2),
    ("SpatialTransformer 640ch 32x32", "transformer", 640, 32, 2),
    ("SpatialTransformer 1280ch 16x16", "transformer", 1280, 16, 2),
    ("VAE AttnBlock 512ch 64x64", "attnblock", 512, 64, 1),
    ("VAE AttnBlock 512ch 128x128", "attnblock", 512, 128, 1),
]
QUICK_BLOCKS = [
    ("SpatialTransformer 64ch 16x16", "transformer", 64, 16, 2),
    ("VAE AttnBlock 64ch 24x24", "attnblock", 64, 24, 1),
]
CONTEXT = (77, 768)  # SD1.5's CLIP text encoder output
QUICK_CONTEXT = (77, 32)

STAND_INS = frozenset(
    ["gradio", "fastapi", "torchvision", "k_diffusion", "open_clip", "transformers", "kornia", "pytorch_lightning"]
    + ["timm", "cv2", "skimage", "pillow_avif"]
)


# ---------------------------------------------------------------------------------------------
# The child: one measurement in a fresh process


def _start_webui(root: str) -> Dict[str, Any]:
    """The web UI's modules, started as modules/initialize.py does, with the stand-ins of tests/_a1111_cases.py."""
    import importlib.abc
    import importlib.machinery
    import types

    class AnyMeta(type):
        def __getattr__(cls, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            made = AnyMeta(name, (AnyThing,), {})
            setattr(cls, name, made)
            return made

    class AnyThing(metaclass=AnyMeta):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return AnyThing()

        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return AnyThing()

    class StandIn(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            made = AnyMeta(name, (AnyThing,), {})
            setattr(self, name, made)
            return made

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
            top = name.split(".")[0]
            if top == "xformers":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return importlib.machinery.ModuleSpec(name, self, is_package=True) if top in STAND_INS else None

        def create_module(self, spec: Any) -> Any:
            module = StandIn(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module: Any) -> None:
            pass

    sys.meta_path.insert(0, Finder())
    sys.argv = [sys.argv[0]]
    os.environ.pop("COMMANDLINE_ARGS", None)
    os.chdir(root)
    sys.path.insert(0, root)
    real_stdout, sys.stdout = sys.stdout, sys.stderr  # the web UI's prints stay out of the JSON line
    try:
        import modules.paths  # noqa: I001  (first: it puts ldm and sgm on the path)
        import ldm.modules.encoders.modules  # noqa: F401
        import sgm.modules.encoders.modules  # noqa: F401
        from modules import shared_init

        shared_init.initialize()
        import modules.sd_models  # noqa: F401
        from modules import script_callbacks, script_loading, sd_hijack, sd_hijack_optimizations, shared

        script_callbacks.on_list_optimizers(sd_hijack_optimizations.list_optimizers)
        script_loading.load_module(os.path.join(root, "extensions", "subquad", "scripts", "subquad_optimization.py"))
        script_callbacks.ui_settings_callback()
        sd_hijack.list_optimizers()
    finally:
        sys.stdout = real_stdout
    return {"shared": shared, "sd_hijack": sd_hijack}


def child(spec: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    torch.set_flush_denormal(True)  # random weights: keep denormals from slowing one variant
    host = _start_webui(spec["root"])
    shared, sd_hijack = host["shared"], host["sd_hijack"]
    import ldm.modules.attention
    import ldm.modules.diffusionmodules.model

    from subquad.integrations import a1111

    variant = spec["variant"]
    if variant.startswith("subquad"):
        shared.opts.subquad_memory_budget = variant.split("-", 1)[1] if "-" in variant else ""
    title = a1111.TITLE if variant.startswith("subquad") else TITLES[variant]
    real_stdout, sys.stdout = sys.stdout, sys.stderr
    try:
        applied = sd_hijack.apply_optimizations(title)
    finally:
        sys.stdout = real_stdout
    if applied != ("subquad" if variant.startswith("subquad") else variant):
        raise RuntimeError(f"A1111 applied {applied!r} for {title!r}")
    forwards = {
        "CrossAttention": ldm.modules.attention.CrossAttention.forward.__name__,
        "AttnBlock": ldm.modules.diffusionmodules.model.AttnBlock.forward.__name__,
    }

    torch.manual_seed(0)
    channels, side, batch = spec["channels"], spec["side"], spec["batch"]
    if spec["kind"] == "transformer":
        heads = 8  # SD1.5: num_heads 8, head dim channels / 8
        block = ldm.modules.attention.SpatialTransformer(
            channels, heads, channels // heads, depth=1, context_dim=spec["context"][1], use_checkpoint=False
        )
        context = torch.randn(batch, *spec["context"])

        def run(s: int) -> Any:
            return block(torch.randn(batch, channels, s, s), context=context)
    else:
        block = ldm.modules.diffusionmodules.model.AttnBlock(channels)

        def run(s: int) -> Any:
            return block(torch.randn(batch, channels, s, s))

    for p in block.parameters():
        p.data.normal_(0.0, 0.02)
    block.eval()
    with torch.no_grad():
        out = run(min(side, 16))
        del out
        before = status_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        start = time.perf_counter()
        out = run(side)
        seconds = time.perf_counter() - start
        peak = status_bytes("VmHWM") - before
        del out
    return {
        "status": "ok",
        "seconds": seconds,
        "peak_growth_bytes": peak,
        "rss_before_bytes": before,
        "forwards": forwards,
    }


# ---------------------------------------------------------------------------------------------
# The parent: rounds of fresh processes, then the tables


def _extract(tmp: str) -> str:
    candidates = [
        os.environ.get("SUBQUAD_HOSTS_DIR"),
        os.path.join(REPO, "..", "shared", "hosts"),
    ]
    for folder in candidates:
        if folder and all(os.path.isfile(os.path.join(folder, name)) for name in [WEBUI, *LAYOUT]):
            with tarfile.open(os.path.join(folder, WEBUI)) as tar:
                tar.extractall(tmp, filter="data")
            root = os.path.join(tmp, "stable-diffusion-webui")
            for archive, under in LAYOUT.items():
                with tarfile.open(os.path.join(folder, archive)) as tar:
                    members = tar.getmembers()
                    for m in members:
                        m.name = m.name.partition("/")[2]
                    tar.extractall(os.path.join(root, under), members=[m for m in members if m.name], filter="data")
            return root
    raise SystemExit(f"no {WEBUI} and {', '.join(LAYOUT)}: pass --webui DIR or set SUBQUAD_HOSTS_DIR")


def _mps_plans(blocks: List[Any]) -> List[str]:
    """What subquad's planner would run on Apple MPS for these blocks' attention calls (fp16, device simulated)."""
    from unittest import mock

    import torch

    import subquad
    from subquad._inputs import Inputs

    lines = []
    with mock.patch.object(Inputs, "device_type", property(lambda self: "mps")):
        for name, kind, channels, side, batch in blocks:
            lq = side * side
            shapes = [("self", (batch, 8, lq, lq, channels // 8)), ("cross", (batch, 8, lq, 77, channels // 8))]
            if kind == "attnblock":
                shapes = [("self", (batch, 1, lq, lq, channels))]
            for which, (b, h, q_len, k_len, e) in shapes:
                q = torch.empty(b, h, q_len, e, dtype=torch.float16)
                k = torch.empty(b, h, k_len, e, dtype=torch.float16)
                plan = subquad.explain(q, k, k, memory_budget="256MiB")
                head = [line.strip() for line in str(plan).splitlines()[1:3]]
                lines.append(
                    f"- {name}, {which}-attention `{(b, h, q_len, k_len, e)}`, budget 256MiB: " + "; ".join(head)
                )
    return lines


def _summary(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        return {"status": runs[0].get("status", "error") if runs else "missing", "reason": runs[0].get("reason", "")}
    t = [r["seconds"] for r in ok]
    m = [r["peak_growth_bytes"] for r in ok]
    return {
        "status": "ok" if len(ok) == len(runs) else f"{len(ok)}/{len(runs)} ok",
        "seconds": statistics.median(t),
        "seconds_min": min(t),
        "seconds_max": max(t),
        "peak": statistics.median(m),
        "peak_min": min(m),
        "peak_max": max(m),
        "forwards": ok[-1]["forwards"],
    }


def _markdown(result: Dict[str, Any]) -> str:
    m, a = result["machine"], result["args"]
    out = [
        "# AUTOMATIC1111 on CPU: the attention blocks under A1111's optimizations and subquad",
        "",
        f"`python benchmarks/hosts_a1111.py {' '.join(result['argv'])}`".replace(" `", "`"),
        "",
        f"{m['date']}; {m['cpu']}, {m['cpus']} CPUs ({m['torch_threads']} torch threads), {m['memory_gib']} GiB; "
        f"torch {m['torch']}, Python {m['python']}, subquad {m['subquad']}; stable-diffusion-webui 1937682a with "
        "the ldm/sgm it pins (the snapshots in shared/hosts). fp32, random weights"
        f"{' (TINY blocks: --quick)' if a['quick'] else ''}. One forward of each block, each variant chosen by its "
        f"title through A1111's `sd_hijack.apply_optimizations`. {a['rounds']} interleaved rounds, every run a fresh "
        "process (`MALLOC_MMAP_THRESHOLD_=131072`); median (min-max). Peak growth: the RSS high-water mark during "
        "the forward minus the RSS before it (the call's working set and its output). subquad's budget is its "
        "default (half the free memory) unless the variant names one.",
        "",
        "No GPU or Apple Silicon machine was available: these are CPU figures only.",
        "",
        "| block | optimization | forward | vs sdp | peak growth | forwards installed |",
        "|---|---|---|---|---|---|",
    ]
    groups = result["summary"]
    for key, job in result["jobs"].items():
        s = groups[key]
        if s["status"] != "ok" and "seconds" not in s:
            out.append(f"| {job['name']} | {job['variant']} | {s['status']} | | | {s.get('reason', '')} |")
            continue
        base = groups.get(_key(dict(job, variant="sdp")), {})
        speed = f"{base['seconds'] / s['seconds']:.2f}x" if "seconds" in base else "-"
        fw = s["forwards"]["CrossAttention" if job["kind"] == "transformer" else "AttnBlock"]
        out.append(
            f"| {job['name']} | {job['variant']} | {s['seconds']:.3f} s ({s['seconds_min']:.3f}-{s['seconds_max']:.3f}) "
            f"| {speed} | {fmt_gib(s['peak'])} ({fmt_gib(s['peak_min'])}-{fmt_gib(s['peak_max'])}) | `{fw}` |"
        )
    out += [
        "",
        "## What the Apple MPS path would run",
        "",
        "Not measured (no Mac here): subquad's planner asked for these fp16 calls with the device taken as MPS:",
        "",
        *result["mps_plans"],
        "",
        "Raw runs: `a1111.json`.",
        "",
    ]
    return "\n".join(out)


def _key(job: Dict[str, Any]) -> str:
    return f"{job['name']} / {job['variant']}"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--webui", help="an A1111 folder with repositories/ laid out (default: extract the snapshots)")
    p.add_argument("--out", help="folder for a1111.md and a1111.json (default docs/benchmarks/data/hosts/hosts-cpu)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny blocks, one round: checks the script")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        try:
            print(json.dumps(child(spec)), flush=True)
        except MemoryError as e:  # an allocation the process could not get is a result
            print(json.dumps({"status": "oom", "reason": f"{type(e).__name__}: {e}"[:300]}), flush=True)
        except RuntimeError as e:
            kind = "oom" if "memory" in str(e).lower() else "error"
            print(json.dumps({"status": kind, "reason": f"{type(e).__name__}: {e}"[:300]}), flush=True)
        return 0

    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS) - {v for v in variants if v.startswith("subquad-")})
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)} (or subquad-<budget>)")
    blocks = QUICK_BLOCKS if args.quick else BLOCKS
    context = QUICK_CONTEXT if args.quick else CONTEXT
    out_dir = args.out or (
        tempfile.mkdtemp(prefix="hosts-a1111-quick-")
        if args.quick
        else os.path.join(REPO, "docs", "benchmarks", "data", "hosts", "hosts-cpu")
    )
    os.makedirs(out_dir, exist_ok=True)
    jobs = [
        {
            "name": name,
            "kind": kind,
            "channels": ch,
            "side": side,
            "batch": batch,
            "context": list(context),
            "variant": v,
        }
        for name, kind, ch, side, batch in blocks
        for v in variants
    ]

    from subquad.integrations import a1111

    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.abspath(args.webui) if args.webui else _extract(tmp)
        installed = a1111.install(root)
        runs: Dict[str, List[Dict[str, Any]]] = {_key(j): [] for j in jobs}
        for r in range(args.rounds):
            order = jobs[r % len(jobs) :] + jobs[: r % len(jobs)]
            for job in order:
                row = run_script_child(
                    __file__,
                    dict(job, root=root),
                    args.timeout,
                    ("SUBQUAD_MEMORY_BUDGET", "COMMANDLINE_ARGS", "ATTN_PRECISION"),
                )
                row["round"] = r
                runs[_key(job)].append(row)
                shown = (
                    f"{row['seconds']:.3f} s, peak +{fmt_gib(row['peak_growth_bytes'])}"
                    if row["status"] == "ok"
                    else f"{row['status']}: {row.get('reason', '')}"
                )
                print(f"round {r + 1}/{args.rounds} {_key(job):<52} {shown}", flush=True)
        if not args.webui:
            a1111.uninstall(root)
        else:
            print(f"(left {installed} installed)")

    result = {
        "argv": list(argv if argv is not None else sys.argv[1:]),
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "machine": machine(),
        "jobs": {_key(j): j for j in jobs},
        "runs": runs,
        "summary": {k: _summary(v) for k, v in runs.items()},
        "mps_plans": _mps_plans(blocks),
    }
    with open(os.path.join(out_dir, "a1111.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = _markdown(result)
    with open(os.path.join(out_dir, "a1111.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {out_dir}/a1111.md and a1111.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
