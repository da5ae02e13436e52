"""``subquad bench --host comfyui PATH``: the node "Which attention? (subquad)" from the command line.

The ComfyUI at ``PATH`` is imported in a child process (:func:`child`; ComfyUI changes global
state when imported), which loads ``--checkpoint`` (or builds a small
SD1.5-config UNet with random weights, and with ``--vae`` a small random VAE) and runs the node's
own measurement (``subquad.integrations.comfyui._which.measure``): the same candidates, rounds,
memory meters and verdicts as the node. Nothing is written under ``PATH`` (no bytecode either).

The parent prints the node's table, then the rows as ``subquad bench --model`` records
(``model_report``: the same table, ``results.json``, ``results.csv`` and figures under ``--out``,
``--compare`` and ``--fail-if-regression`` in ``cli``), and the node's chart as ``which.png``.
``cli`` uses :func:`run`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
from typing import Any, Optional

import torch

from .._version import __version__
from ..integrations.comfyui import _which
from ..integrations.comfyui._hooks import host
from . import model_report
from .args import Checked
from .model_measure import ModelResult

SMALL_SD15 = {  # SD1.5's config (comfy.supported_models.SD15) with small widths: 8 heads of 8 and 16 dims
    "model_channels": 64,
    "context_dim": 768,
    "in_channels": 4,
    "out_channels": 4,
    "num_res_blocks": [1, 1],
    "channel_mult": [1, 2],
    "transformer_depth": [1, 1],
    "transformer_depth_output": [1, 1, 1, 1],
    "transformer_depth_middle": 1,
    "use_spatial_transformer": True,
    "legacy": False,
    "image_size": 32,
    "use_linear_in_transformer": False,
    "adm_in_channels": None,
    "use_temporal_attention": False,
}
SMALL_VAE: dict[str, Any] = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3}
SMALL_VAE.update({"ch": 32, "ch_mult": [1, 2], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0})
RANDOM = "a small SD1.5-config UNet with random weights (pass --checkpoint NAME for your model)"
STATUS = {"ok": "ok", "out of memory": "oom", "refused": "unsupported", "error": "error"}


def run(args: argparse.Namespace, checked: Checked) -> Optional[list[ModelResult]]:
    """Run the child, print and save what it measured; its records (``None`` when the child failed)."""
    size = checked.sizes[0]
    label = os.path.basename(checked.checkpoint) if checked.checkpoint else RANDOM
    print(f"subquad bench --host comfyui {checked.host}: {label}, {size} px", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "which.json")
        job = dict(
            root=checked.host,
            checkpoint=checked.checkpoint,
            vae=bool(args.vae),
            size=size,
            batch=args.batch or 1,
            rounds=6 if args.rounds is None else max(1, args.rounds),
            cap=str(checked.cap) if checked.cap is not None else None,
            out=out_path,
        )
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # freed tensors leave the process: RSS peaks are honest
        code = "import json, sys; from subquad.bench.host_comfyui import child; child(json.loads(sys.argv[1]))"
        child = subprocess.run([sys.executable, "-c", code, json.dumps(job)], env=env, cwd=tmp)
        if child.returncode != 0 or not os.path.isfile(out_path):
            print(f"subquad bench: the ComfyUI child process failed (status {child.returncode})", file=sys.stderr)
            return None
        with open(out_path, encoding="utf-8") as f:
            which = _loaded(json.load(f))
    which_text = _which.table(which)
    results = records(which, label, size, args.batch or 1)
    print(which_text + "\n")
    print(model_report.render(results), end="")
    if args.out:
        paths = model_report.save(results, args.out)
        with open(os.path.join(args.out, "which.txt"), "w", encoding="utf-8") as f:
            f.write(which_text + "\n")
        paths.append(os.path.join(args.out, "which.txt"))
        fig = _which.figure(which)  # None without matplotlib
        if fig is not None:
            fig.savefig(os.path.join(args.out, "which.png"))
            paths.append(os.path.join(args.out, "which.png"))
        print("wrote " + ", ".join(paths))
    return results


def records(which: _which.Which, label: str, size: int, batch: int) -> list[ModelResult]:
    """The node's rows as ``subquad bench --model`` records (one per candidate and part)."""
    out = []
    for row in which.rows:
        ms = [t * 1e3 for t in row.times]
        q = _quartiles(ms)
        out.append(
            ModelResult(
                model=f"comfyui: {label}",
                impl=row.name,
                task="infer",
                mode=row.part,
                size=size,
                size_unit="px",
                status=STATUS.get(row.status, "error"),
                reason=row.reason or None,
                median_ms=q[1],
                q1_ms=q[0],
                q3_ms=q[2],
                times_ms=ms,
                rounds=len(ms),
                peak_bytes=row.peak_bytes,
                memory_method=which.meter,
                max_abs_diff=row.diff,
                output_abs_max=1.0 if row.diff is not None else None,  # the difference is relative
                reference=which.reference.get(row.part, ""),
                cap_bytes=which.cap_bytes,
                over_cap=row.over_cap if which.cap_bytes is not None else None,
                batch=batch,
                device=which.setting.rsplit(" on ", 1)[-1],
                torch_version=torch.__version__,
                subquad_version=__version__,
            )
        )
    return out


def _quartiles(values: list[float]) -> tuple[Optional[float], Optional[float], Optional[float]]:
    if not values:
        return None, None, None
    xs, n = sorted(values), len(values)

    def at(p: float) -> float:
        i = p * (n - 1)
        lo = int(i)
        return xs[lo] + (xs[min(lo + 1, n - 1)] - xs[lo]) * (i - lo)

    return at(0.25), at(0.5), at(0.75)


def _loaded(data: dict) -> _which.Which:
    rows = [_which.Row(**row) for row in data.pop("rows")]
    return _which.Which(rows=rows, **data)


# ----------------------------------------------------------------------------------- the child


def child(job: dict) -> None:
    """In the child: import the ComfyUI at ``job["root"]``, build or load the model, measure, write JSON."""
    root = job["root"]
    sys.path.insert(0, root)
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        host("comfy.cli_args").args.cpu = True  # ComfyUI's model management needs it with a CPU-only torch
    comfy = host("comfy.model_management")
    model, vae = _model(job, comfy.get_torch_device())
    setting = _which.Setting(
        job["size"],
        job["size"],
        job["batch"],
        1,
        job["rounds"],
        job["cap"],
        progress=lambda done, total: print(f"\r{done}/{total} calls", end="", file=sys.stderr, flush=True),
    )
    which = _which.measure(model, vae, setting)
    print(file=sys.stderr)
    data: dict[str, Any] = dataclasses.asdict(which)
    data.pop("chosen")
    with open(job["out"], "w", encoding="utf-8") as f:
        json.dump(data, f)


def _model(job: dict, device: torch.device) -> tuple[Any, Any]:
    if job["checkpoint"]:
        model, _, vae, _ = host("comfy.sd").load_checkpoint_guess_config(
            job["checkpoint"], output_vae=job["vae"], output_clip=False
        )
        return model, vae if job["vae"] else None
    torch.manual_seed(0)
    base = host("comfy.supported_models").SD15(dict(SMALL_SD15)).get_model({})
    for p in base.parameters():
        p.data.normal_(0.0, 0.02)
    model = host("comfy.model_patcher").ModelPatcher(base, load_device=device, offload_device=torch.device("cpu"))
    vae = None
    if job["vae"]:
        logging.disable(logging.WARNING)  # "Missing VAE keys": the weights are set just below
        try:
            vae = host("comfy.sd").VAE(sd={}, config={"params": {"ddconfig": dict(SMALL_VAE), "embed_dim": 4}})
        finally:
            logging.disable(logging.NOTSET)
        for p in vae.first_stage_model.parameters():
            p.data.normal_(0.0, 0.05)
    return model, vae
