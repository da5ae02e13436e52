"""Peak memory of a UNet forward at a large latent size: diffusers' processors vs subquad.

The UNet is SD 1.5's highest-resolution level built from config with random weights (320
channels, 8 heads x 40, cross-attention to 77 text tokens of 768), two levels deep, so that the
attention at ``latent x latent`` tokens dominates as it does in SD 1.5 at high resolution.
Nothing is downloaded.

Each processor runs in a fresh process (the model, its inputs and one forward):

- ``AttnProcessor``: diffusers' classic processor (baddbmm + softmax; the scores exist whole).
  diffusers uses it where SDPA is missing or ``scale_qk=False``.
- ``AttnProcessor2_0``: diffusers' default, ``torch.nn.functional.scaled_dot_product_attention``.
- ``subquad``: ``subquad.integrations.diffusers.enable(unet, memory_budget=...)``.

Peak extra memory = the forward's high-water mark minus what the process held before it. On CPU
that is the RSS high-water mark (``VmHWM`` after writing ``5`` to ``/proc/self/clear_refs``),
measured with ``MALLOC_MMAP_THRESHOLD_=131072`` so that freed tensors leave the RSS; on CUDA,
``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. A forward that dies of
memory is recorded as ``oom``.

    python docs/examples/diffusers_unet_memory.py --latent 96 --budget 256MiB
    python docs/examples/diffusers_unet_memory.py --latent 128 --device cuda --dtype float16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PROCESSORS = ("AttnProcessor", "AttnProcessor2_0", "subquad")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _unet(latent: int):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=latent,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(320, 640),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=768,
        attention_head_dim=8,  # diffusers' name for the number of heads here: 8 x 40 at 320 channels
        norm_num_groups=32,
    )


def worker(args: argparse.Namespace) -> dict:
    import gc

    import torch
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    unet = _unet(args.latent).to(device=device, dtype=dtype).eval()
    if args.processor == "subquad":
        from subquad.integrations.diffusers import enable

        enable(unet, memory_budget=args.budget)
    else:
        unet.set_attn_processor(AttnProcessor() if args.processor == "AttnProcessor" else AttnProcessor2_0())
    g = torch.Generator().manual_seed(1)
    sample = torch.randn(args.batch, 4, args.latent, args.latent, generator=g).to(device, dtype)
    text = torch.randn(args.batch, 77, 768, generator=g).to(device, dtype)
    gc.collect()

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status("VmRSS")
    start = time.perf_counter()
    with torch.no_grad():
        out = unet(sample, 10, encoder_hidden_states=text).sample
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _status("VmHWM") - before
    seconds = time.perf_counter() - start
    torch.save(out.float().cpu(), args.output)
    return {"processor": args.processor, "status": "ok", "peak_extra_bytes": peak, "seconds": seconds}


def _run_one(args: argparse.Namespace, processor: str, output: str) -> dict:
    cmd = [
        sys.executable, os.path.abspath(__file__), "--worker", "--processor", processor,
        "--latent", str(args.latent), "--batch", str(args.batch), "--budget", args.budget,
        "--device", args.device, "--dtype", args.dtype, "--output", output,
    ]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        killed = proc.returncode in (-9, 137) or "out of memory" in tail[0].lower()
        return {"processor": processor, "status": "oom" if killed else "error", "reason": tail[0]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--latent", type=int, default=96, help="latent side (tokens per attention = latent**2)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--budget", default="256MiB", help="subquad's memory_budget")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--processors", default=",".join(PROCESSORS))
    p.add_argument("--json", help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--processor", help=argparse.SUPPRESS)
    p.add_argument("--output", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    import torch

    tokens = args.latent**2
    print(
        f"UNet forward, latent {args.latent}x{args.latent} ({tokens} tokens per self-attention, 8 heads x 40), "
        f"batch {args.batch}, {args.dtype} on {args.device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; subquad memory_budget={args.budget}"
    )
    results, outputs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.processors.split(","):
            path = os.path.join(tmp, f"{name}.pt")
            r = _run_one(args, name, path)
            if r["status"] == "ok":
                outputs[name] = torch.load(path)
            results.append(r)
            shown = _gib(r["peak_extra_bytes"]) if r["status"] == "ok" else r["status"]
            extra = f"{r['seconds']:.1f} s" if r["status"] == "ok" else r.get("reason", "")
            print(f"  {name:<17} peak extra {shown:>10}   {extra}", flush=True)
    reference = outputs.get("AttnProcessor2_0")
    if reference is not None and "subquad" in outputs:
        diff = (outputs["subquad"] - reference).abs().max().item()
        print(f"  max |subquad - AttnProcessor2_0| = {diff:.2e} (output max {reference.abs().max().item():.2f})")
        for r in results:
            if r["processor"] == "subquad":
                r["max_abs_diff_vs_sdpa"] = diff
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
