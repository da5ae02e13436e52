"""ComfyUI on CPU: one UNet sampler step and VAE decodes, ComfyUI's own attention against the subquad nodes.

Issue 28's measurement, inside ComfyUI's real code (the v0.3.64 snapshot in shared/hosts, or
``--comfyui DIR``), with random weights and the configs of ComfyUI's own ``supported_models.SD15``
and SD's ``AutoencoderKL``, fp32:

- **UNet**: one ``common_ksampler`` step (euler, cfg 7: cond and uncond in one batch) at 512 px,
  batch 1 and 2, for ComfyUI's default CPU attention (``attention_sub_quad``), ComfyUI's PyTorch
  attention (``--use-pytorch-cross-attention``) and the "Subquad attention (model)" node (loaded
  by ComfyUI's ``nodes.load_custom_node`` from the folder ``subquad install comfyui`` writes;
  budget: subquad's default, half the free memory);
- **VAE decode** at 512, 1024 and 2048 px: ComfyUI's default (``normal_attention`` ->
  ``slice_attention``), its PyTorch attention, and the "Subquad attention (VAE)" node at 64 MiB
  and 256 MiB.

Every run is a fresh Python process started with ``MALLOC_MMAP_THRESHOLD_=131072`` (freed tensors
go back to the OS): it builds the model, runs one warm-up (the same step; for the VAE a 256 px
decode), resets the RSS high-water mark (``5`` into ``/proc/self/clear_refs``), and reports the
time of one more step/decode and ``VmHWM`` minus the RSS before it ("peak growth": the call's
working set and its output). Rounds are interleaved (every variant once per round, the order
rotated each round); the tables give the median and the min-max spread. Each run also counts the
attention calls that went through ``subquad.sdpa``, ComfyUI's sub-quad and its ``slice_attention``,
so a row shows what really ran. A run the kernel kills for memory is a result ("killed").

::

    python benchmarks/hosts_comfyui.py                         # the full measurement -> docs/benchmarks/data/hosts/hosts-cpu/
    python benchmarks/hosts_comfyui.py --quick --out /tmp/hq   # tiny configs, one round: checks the script
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

from _harness import fmt_gib, machine, reset_hwm, run_script_child, status_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
SNAPSHOT = "ComfyUI-a125cd84.tar.gz"

UNET_VARIANTS = ("comfyui-sub-quad", "comfyui-pytorch", "subquad")
VAE_VARIANTS = ("comfyui-default", "comfyui-pytorch", "subquad-64MiB", "subquad-256MiB")

SD_VAE = {  # SD1.x/SDXL AutoencoderKL (comfy.sd.VAE's config for these checkpoints)
    "double_z": True,
    "z_channels": 4,
    "resolution": 256,
    "in_channels": 3,
    "out_ch": 3,
    "ch": 128,
    "ch_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "attn_resolutions": [],
    "dropout": 0.0,
}
SD15_UNET = {  # what ComfyUI's model detection finds in an SD1.5 checkpoint (SD15.unet_config adds the rest)
    "image_size": 32,
    "in_channels": 4,
    "out_channels": 4,
    "model_channels": 320,
    "num_res_blocks": [2, 2, 2, 2],
    "channel_mult": [1, 2, 4, 4],
    "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0],
    "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
    "transformer_depth_middle": 1,
    "use_spatial_transformer": True,
    "legacy": False,
    "use_temporal_resblock": False,
}
TINY_VAE = dict(SD_VAE, ch=32, ch_mult=[1, 2], num_res_blocks=1)
TINY_UNET = {  # SD15's config with tiny widths (as tests/_comfyui_cases.py)
    "model_channels": 32,
    "context_dim": 32,
    "num_res_blocks": [1, 1],
    "channel_mult": [1, 2],
    "transformer_depth": [1, 1],
    "transformer_depth_output": [1, 1, 1, 1],
    "transformer_depth_middle": 1,
}


# ---------------------------------------------------------------------------------------------
# The child: one measurement in a fresh process


def _import_comfyui(root: str, pytorch_attention: bool) -> Dict[str, Any]:
    import importlib.machinery
    import types

    # The torchvision wheel links CUDA and fails next to a CPU torch; only model files this run
    # never builds (cascade, cosmos, ace) import it.
    tv = types.ModuleType("torchvision")
    tv.__path__ = []  # type: ignore[attr-defined]
    tv.__spec__ = importlib.machinery.ModuleSpec("torchvision", None, is_package=True)
    tr = types.ModuleType("torchvision.transforms")
    tr.__spec__ = importlib.machinery.ModuleSpec("torchvision.transforms", None)
    tv.transforms = tr  # type: ignore[attr-defined]
    sys.modules.update({"torchvision": tv, "torchvision.transforms": tr})
    sys.path.insert(0, root)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    comfy.cli_args.args.disable_xformers = True
    comfy.cli_args.args.use_pytorch_cross_attention = pytorch_attention
    import comfy.ldm.modules.attention as attn
    import comfy.ldm.modules.diffusionmodules.model as vae_model
    import comfy.model_patcher
    import comfy.sd
    import comfy.supported_models
    import nodes

    import subquad

    counts = {"subquad": 0, "comfyui_sub_quad": 0, "comfyui_slice": 0}

    def counted(key: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return fn(*args, **kwargs)

        return wrapper

    subquad.sdpa = counted("subquad", subquad.sdpa)
    attn.efficient_dot_product_attention = counted("comfyui_sub_quad", attn.efficient_dot_product_attention)
    vae_model.slice_attention = counted("comfyui_slice", vae_model.slice_attention)
    return {"nodes": nodes, "comfy": comfy, "counts": counts}


def _load_node(host: Dict[str, Any], root: str, name: str) -> Any:
    import asyncio

    path = os.path.join(root, "custom_nodes", "subquad")
    if not asyncio.run(host["nodes"].load_custom_node(path)):
        raise RuntimeError(f"ComfyUI could not load {path}")
    return host["nodes"].NODE_CLASS_MAPPINGS[name]()


class _Marks:
    """RSS marks across a call that contains attention calls measured on their own.

    Each measured attention call resets the high-water mark (so its own peak is known); the
    mark reached before it is kept, so the whole call's peak is still the largest of them."""

    def __init__(self) -> None:
        self.before = 0
        self.marks: List[int] = []
        self.attention: List[Dict[str, int]] = []

    def start(self) -> None:
        self.marks, self.attention = [], []
        self.before = status_bytes("VmRSS")
        reset_hwm()

    def peak_growth(self) -> int:
        return max(self.marks + [status_bytes("VmHWM")]) - self.before

    def measured(self, fn: Any) -> Any:
        def wrapper(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
            self.marks.append(status_bytes("VmHWM"))
            before = status_bytes("VmRSS")
            reset_hwm()
            out = fn(q, k, v, **kwargs)
            growth = status_bytes("VmHWM") - before
            self.attention.append(
                {"growth": growth, "output": out.numel() * out.element_size(), "tokens": q[0, 0].numel()}
            )
            return out

        return wrapper


def child(spec: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    torch.set_flush_denormal(True)  # random weights: keep denormals from slowing one variant
    variant, quick = spec["variant"], spec["quick"]
    host = _import_comfyui(spec["root"], pytorch_attention=variant == "comfyui-pytorch")
    comfy, nodes, counts = host["comfy"], host["nodes"], host["counts"]
    marks = _Marks()
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    if spec["kind"] == "unet":
        config = dict(comfy.supported_models.SD15.unet_config, **SD15_UNET)
        if quick:
            config.update(TINY_UNET)
        base = comfy.supported_models.SD15(config).get_model({})
        for p in base.parameters():
            p.data.normal_(0.0, 0.02)
        model = comfy.model_patcher.ModelPatcher(base, load_device=cpu, offload_device=cpu)
        if variant == "subquad":
            (model,) = _load_node(host, spec["root"], "SubquadModelAttention").patch(model, spec.get("budget", ""))
        context = config["context_dim"]
        g = torch.Generator().manual_seed(1)
        positive = [[torch.randn(1, 77, context, generator=g), {}]]
        negative = [[torch.randn(1, 77, context, generator=g), {}]]
        latent = {"samples": torch.zeros(spec["batch"], 4, spec["size"] // 8, spec["size"] // 8)}

        def run() -> Any:
            return nodes.common_ksampler(model, 1, 1, 7.0, "euler", "normal", positive, negative, latent)

        warm = run
    else:
        # The VAE's attention functions are measured on their own as well: ComfyUI's (bound into
        # each block when it is built, so wrapped before) and subquad's (looked up per call).
        vae_model = sys.modules["comfy.ldm.modules.diffusionmodules.model"]
        for name in ("normal_attention", "pytorch_attention"):
            setattr(vae_model, name, marks.measured(getattr(vae_model, name)))
        from subquad.integrations.comfyui import _attention  # the VAE node's calls look it up there

        _attention.vae_attention = marks.measured(_attention.vae_attention)
        config = TINY_VAE if quick else SD_VAE
        vae = comfy.sd.VAE(sd={}, config={"params": {"ddconfig": config, "embed_dim": 4}})
        for p in vae.first_stage_model.parameters():
            p.data.normal_(0.0, 0.02)
        if variant.startswith("subquad"):
            (vae,) = _load_node(host, spec["root"], "SubquadVAEAttention").patch(vae, variant.split("-", 1)[1])
        side = spec["size"] // 8
        latent = torch.randn(1, 4, side, side, generator=torch.Generator().manual_seed(2))

        def run() -> Any:
            return vae.decode(latent)

        def warm() -> Any:
            return vae.decode(latent[:, :, : min(side, 32), : min(side, 32)])

        if spec["kind"] == "vae-mid":
            # The decoder up to and through its middle block (conv_in, ResnetBlock, AttnBlock,
            # ResnetBlock at the latent's resolution, 512 channels): where the VAE's attention is,
            # without the full-resolution convolutions after it, which alone outgrow this VM in
            # float32 from 1024 px on. ComfyUI applies the node's object patches when it loads
            # the model, as vae.decode() does first.
            comfy.model_management.load_models_gpu([vae.patcher])
            stage = vae.first_stage_model
            decoder = stage.decoder

            def middle(z: Any) -> Any:
                with torch.no_grad():
                    h = decoder.conv_in(stage.post_quant_conv(z))
                    h = decoder.mid.block_1(h, None)
                    h = decoder.mid.attn_1(h)
                    return decoder.mid.block_2(h, None)

            def run() -> Any:
                return middle(latent)

            def warm() -> Any:
                return middle(latent[:, :, : min(side, 32), : min(side, 32)])

    out = warm()
    del out
    for key in counts:
        counts[key] = 0
    marks.start()
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    result = {
        "status": "ok",
        "seconds": seconds,
        "peak_growth_bytes": marks.peak_growth(),
        "rss_before_bytes": marks.before,
        "calls": counts,
    }
    if marks.attention:
        result["attention"] = marks.attention
    return result


# ---------------------------------------------------------------------------------------------
# The parent: rounds of fresh processes, then the tables


def _jobs(args: argparse.Namespace) -> List[Dict[str, Any]]:
    jobs = []
    if "unet" in args.only:
        for batch in args.unet_batches:
            for variant in args.unet_variants:
                jobs.append({"kind": "unet", "variant": variant, "batch": batch, "size": args.unet_size})
    for kind, sizes in (("vae", args.vae_sizes), ("vae-mid", args.vae_mid_sizes)):
        if kind in args.only:
            for size in sizes:
                for variant in args.vae_variants:
                    jobs.append({"kind": kind, "variant": variant, "batch": 1, "size": size})
    return jobs


def _key(job: Dict[str, Any]) -> str:
    return f"{job['kind']}-{job['size']}px-b{job['batch']}-{job['variant']}"


def _extract(tmp: str) -> str:
    candidates = [
        os.environ.get("SUBQUAD_HOSTS_DIR"),
        os.path.join(REPO, "..", "shared", "hosts"),
    ]
    for folder in candidates:
        if folder and os.path.isfile(os.path.join(folder, SNAPSHOT)):
            with tarfile.open(os.path.join(folder, SNAPSHOT)) as tar:
                tar.extractall(tmp, filter="data")
            return os.path.join(tmp, "ComfyUI")
    raise SystemExit(f"no {SNAPSHOT}: pass --comfyui DIR or set SUBQUAD_HOSTS_DIR")


def _mps_plans() -> List[str]:
    """What subquad's planner would run on Apple MPS for these calls (fp16; the device simulated)."""
    from unittest import mock

    import torch

    import subquad
    from subquad._inputs import Inputs

    cases = [
        ("SD1.5 UNet self-attention, 512 px, batch 1 + cfg", (2, 8, 4096, 4096, 40), "4GiB"),
        ("SD1.5 UNet self-attention, 1024 px, batch 1 + cfg", (2, 8, 16384, 16384, 40), "4GiB"),
        ("VAE mid-block attention, 1024 px", (1, 1, 16384, 16384, 512), "256MiB"),
        ("VAE mid-block attention, 2048 px", (1, 1, 65536, 65536, 512), "256MiB"),
        ("VAE mid-block attention, 2048 px", (1, 1, 65536, 65536, 512), "64MiB"),
    ]
    lines = []
    with mock.patch.object(Inputs, "device_type", property(lambda self: "mps")):
        for label, (b, h, lq, lk, e), budget in cases:
            q = torch.empty(b, h, lq, e, dtype=torch.float16)
            k = torch.empty(b, h, lk, e, dtype=torch.float16)
            plan = subquad.explain(q, k, k, memory_budget=budget)
            head = [line.strip() for line in str(plan).splitlines()[1:3]]
            lines.append(f"- {label} `{(b, h, lq, lk, e)}`, budget {budget}: " + "; ".join(head))
    return lines


def _summary(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        return {"status": runs[0].get("status", "error") if runs else "missing", "reason": runs[0].get("reason", "")}
    t = [r["seconds"] for r in ok]
    m = [r["peak_growth_bytes"] for r in ok]
    extra = [max(a["growth"] - a["output"] for a in r["attention"]) for r in ok if r.get("attention")]
    return {
        "attention_extra": statistics.median(extra) if extra else None,
        "attention_extra_max": max(extra) if extra else None,
        "status": "ok" if len(ok) == len(runs) else f"{len(ok)}/{len(runs)} ok",
        "seconds": statistics.median(t),
        "seconds_min": min(t),
        "seconds_max": max(t),
        "peak": statistics.median(m),
        "peak_min": min(m),
        "peak_max": max(m),
        "calls": ok[-1]["calls"],
    }


def _calls(c: Dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in c.items() if v) or "-"


def _markdown(result: Dict[str, Any]) -> str:
    m, a = result["machine"], result["args"]
    out = [
        "# ComfyUI on CPU: ComfyUI's attention vs the subquad nodes",
        "",
        f"`python benchmarks/hosts_comfyui.py {' '.join(result['argv'])}`".replace(" `", "`"),
        "",
        f"{m['date']}; {m['cpu']}, {m['cpus']} CPUs ({m['torch_threads']} torch threads), {m['memory_gib']} GiB; "
        f"torch {m['torch']}, Python {m['python']}, subquad {m['subquad']}, ComfyUI {result['comfyui_version']} "
        f"(the snapshot in shared/hosts). fp32, random weights{' (TINY configs: --quick)' if a['quick'] else ''}. "
        f"{a['rounds']} interleaved rounds, every run a fresh process (`MALLOC_MMAP_THRESHOLD_=131072`); "
        "median (min-max). Peak growth: the RSS high-water mark during the call minus the RSS before it "
        "(the call's working set and its output). Calls: attention calls that went through `subquad.sdpa`, "
        "ComfyUI's sub-quad (`efficient_dot_product_attention`) and its VAE `slice_attention`.",
        "",
        "No GPU or Apple Silicon machine was available: these are CPU figures only.",
        "",
    ]
    groups = result["summary"]
    unet = [k for k in groups if k.startswith("unet")]
    if unet:
        out += [
            f"## SD1.5-size UNet: one sampler step (euler, cfg 7), {a['unet_size']} px",
            "",
            "| batch | attention | step | vs ComfyUI default | peak growth | calls |",
            "|---|---|---|---|---|---|",
        ]
        for key in unet:
            s, job = groups[key], result["jobs"][key]
            base = groups.get(key.replace(job["variant"], "comfyui-sub-quad"), {})
            if s["status"] != "ok" and "seconds" not in s:
                out.append(f"| {job['batch']} | {job['variant']} | {s['status']} | | | {s.get('reason', '')} |")
                continue
            speed = f"{base['seconds'] / s['seconds']:.2f}x" if "seconds" in base else "-"
            out.append(
                f"| {job['batch']} | {job['variant']} | {s['seconds']:.2f} s ({s['seconds_min']:.2f}-{s['seconds_max']:.2f}) "
                f"| {speed} | {fmt_gib(s['peak'])} ({fmt_gib(s['peak_min'])}-{fmt_gib(s['peak_max'])}) "
                f"| {_calls(s['calls'])} |"
            )
        out.append("")
    sections = (
        (
            "vae-",
            "## VAE decode (SD's AutoencoderKL decoder, batch 1)",
            "From 1024 px the whole float32 decode outgrows this 24 GiB VM in its full-resolution "
            "convolutions, whatever the attention (ComfyUI's default and its PyTorch attention were both "
            "killed there in a first run), so the whole decode is measured at 512 px and the attention at "
            "every size in the next table.",
        ),
        (
            "vae-mid-",
            "## VAE decoder's middle block (conv_in, ResnetBlock, AttnBlock, ResnetBlock at the latent's resolution)",
            "The part of the decode where its attention is: one head of 512 channels over (px/8)^2 tokens.",
        ),
    )
    for prefix, title, text in sections:
        vae = [k for k in groups if k.startswith(prefix) and not (prefix == "vae-" and k.startswith("vae-mid-"))]
        if not vae:
            continue
        out += [
            title,
            "",
            text,
            "",
            "Attention call: the growth during the attention call itself, minus its output (what a budget "
            "bounds), the largest of the calls; median (max) over the rounds.",
            "",
            "| size | attention | time | peak growth | attention call | calls |",
            "|---|---|---|---|---|---|",
        ]
        for key in vae:
            s, job = groups[key], result["jobs"][key]
            if s["status"] != "ok" and "seconds" not in s:
                out.append(f"| {job['size']} px | {job['variant']} | {s['status']} | | | {s.get('reason', '')} |")
                continue
            out.append(
                f"| {job['size']} px | {job['variant']} | {s['seconds']:.2f} s ({s['seconds_min']:.2f}-{s['seconds_max']:.2f}) "
                f"| {fmt_gib(s['peak'])} ({fmt_gib(s['peak_min'])}-{fmt_gib(s['peak_max'])}) "
                f"| {fmt_gib(s['attention_extra'])} ({fmt_gib(s['attention_extra_max'])}) | {_calls(s['calls'])} |"
            )
        out.append("")
    out += [
        "## What the Apple MPS path would run",
        "",
        "Not measured (no Mac here): subquad's planner asked for these fp16 calls with the device taken as MPS:",
        "",
        *result["mps_plans"],
        "",
        f"Raw runs: `{result['stem']}.json`.",
        "",
    ]
    return "\n".join(out)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--comfyui", help="an extracted ComfyUI folder (default: extract the snapshot to a temp folder)")
    p.add_argument(
        "--out",
        help="folder for comfyui.md/.json (comfyui-unet.* or comfyui-vae.* with --only); default docs/benchmarks/data/hosts/hosts-cpu",
    )
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny configs, small sizes, one round: checks the script")
    p.add_argument(
        "--only", default="unet,vae,vae-mid", help="any of unet, vae (the whole decode), vae-mid (its middle block)"
    )
    p.add_argument("--unet-variants", default=",".join(UNET_VARIANTS))
    p.add_argument("--unet-batches", default="1,2")
    p.add_argument("--vae-variants", default=",".join(VAE_VARIANTS))
    p.add_argument(
        "--vae-sizes",
        help="pixels of the whole decode (default 512: from 1024 px the float32 decoder's convolutions alone "
        "outgrow a 24 GiB machine, whatever the attention; 64,128 with --quick)",
    )
    p.add_argument(
        "--vae-mid-sizes", help="pixels of the middle-block runs (default 512,1024,2048; 64,128 with --quick)"
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
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
    if args.vae_sizes is None:
        args.vae_sizes = "64,128" if args.quick else "512"
    if args.vae_mid_sizes is None:
        args.vae_mid_sizes = "64,128" if args.quick else "512,1024,2048"
    args.only = args.only.split(",")
    args.unet_variants = args.unet_variants.split(",")
    args.vae_variants = args.vae_variants.split(",")
    args.unet_batches = [int(x) for x in args.unet_batches.split(",")]
    args.vae_sizes = [int(x) for x in args.vae_sizes.split(",")]
    args.vae_mid_sizes = [int(x) for x in args.vae_mid_sizes.split(",")]
    args.unet_size = 128 if args.quick else 512
    out_dir = args.out or (
        tempfile.mkdtemp(prefix="hosts-comfyui-quick-")
        if args.quick
        else os.path.join(REPO, "docs", "benchmarks", "data", "hosts", "hosts-cpu")
    )
    os.makedirs(out_dir, exist_ok=True)

    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.abspath(args.comfyui) if args.comfyui else _extract(tmp)
        from subquad.integrations import comfyui

        installed = comfyui.install(root)
        with open(os.path.join(root, "comfyui_version.py")) as f:
            version = next((line.split("=")[1].strip().strip("\"'") for line in f if "__version__" in line), "unknown")
        jobs = _jobs(args)
        runs: Dict[str, List[Dict[str, Any]]] = {_key(j): [] for j in jobs}
        for r in range(args.rounds):
            order = jobs[r % len(jobs) :] + jobs[: r % len(jobs)] if jobs else []
            for job in order:
                spec = dict(job, root=root, quick=args.quick)
                row = run_script_child(
                    __file__, spec, args.timeout, ("SUBQUAD_COMFYUI_DEFAULT", "SUBQUAD_MEMORY_BUDGET")
                )
                row["round"] = r
                runs[_key(job)].append(row)
                shown = (
                    f"{row['seconds']:.2f} s, peak +{fmt_gib(row['peak_growth_bytes'])}, {_calls(row['calls'])}"
                    if row["status"] == "ok"
                    else f"{row['status']}: {row.get('reason', '')}"
                )
                print(f"round {r + 1}/{args.rounds} {_key(job):<42} {shown}", flush=True)
        if not args.comfyui:
            comfyui.uninstall(root)
        elif installed.exists():
            print(f"(left {installed} installed)")

    stem = "comfyui" if len(args.only) > 1 else f"comfyui-{args.only[0]}"
    result = {
        "stem": stem,
        "argv": list(argv if argv is not None else sys.argv[1:]),
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "machine": machine(),
        "comfyui_version": version,
        "jobs": {_key(j): j for j in jobs},
        "runs": runs,
        "summary": {k: _summary(v) for k, v in runs.items()},
        "mps_plans": _mps_plans(),
    }
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as f:
        json.dump(result, f, indent=1)
    text = _markdown(result)
    with open(os.path.join(out_dir, f"{stem}.md"), "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {out_dir}/{stem}.md and {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
