"""The ComfyUI checks of "Which attention? (subquad)", run in one child process against ComfyUI's real code.

``python tests/_comfyui_which_cases.py COMFYUI_ROOT [case ...]`` (run by tests/test_hosts_comfyui_which.py),
one JSON line per case, as tests/_comfyui_cases.py does (its bootstrap, copied: ComfyUI is imported
here, never in the pytest process; ``torchvision`` is a stand-in). The node is loaded by ComfyUI's
``nodes.load_custom_node`` from the folder ``subquad install comfyui`` writes, and runs on a tiny
SD1.5-config UNet and a tiny ``AutoencoderKL`` at 64 px. Nothing here depends on this machine's
speed: the checks are on structure; the winner logic is checked with injected timings in
tests/test_bench_host.py.
"""

from __future__ import annotations

import asyncio
import importlib.machinery
import logging
import sys
import types

from _comfyui_models import TINY_UNET, TINY_VAE
from _host_snapshots import Worker

ROOT = sys.argv[1]
WORKER = Worker("ComfyUI", ROOT, own=["comfy", "comfy_extras", "comfy_api", "comfy_execution", "nodes"])
case = WORKER.case


def _torchvision_stand_in():
    tv = types.ModuleType("torchvision")
    tv.__path__ = []
    tv.__spec__ = importlib.machinery.ModuleSpec("torchvision", None, is_package=True)
    tr = types.ModuleType("torchvision.transforms")
    tr.__spec__ = importlib.machinery.ModuleSpec("torchvision.transforms", None)

    def missing(name):
        raise AttributeError(f"torchvision stand-in (tests/_comfyui_which_cases.py): no {name}")

    tr.__getattr__ = missing
    tv.transforms = tr
    sys.modules["torchvision"] = tv
    sys.modules["torchvision.transforms"] = tr


import torch  # noqa: E402

with WORKER.imports():
    _torchvision_stand_in()
    sys.path.insert(0, ROOT)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # a CPU-only torch: model_management raises without it
    comfy.cli_args.args.disable_xformers = True
    import comfy.ldm.modules.attention as attn
    import comfy.model_management
    import comfy.model_patcher
    import comfy.sd
    import comfy.supported_models
    import comfy.utils
    import nodes

import subquad.integrations.comfyui as sqc  # noqa: E402

logging.getLogger().setLevel(logging.ERROR)
CPU = torch.device("cpu")
_LOADED = {}


def check(cond, message):
    if not cond:
        raise AssertionError(message)


def node_class():
    """Install the node folder into the extracted ComfyUI and load it with ComfyUI's own loader."""
    if not _LOADED:
        path = sqc.install(ROOT)
        check(asyncio.run(nodes.load_custom_node(str(path))), f"load_custom_node({path}) failed")
        _LOADED.update(nodes.NODE_CLASS_MAPPINGS)
    return _LOADED["SubquadWhichAttention"]


def tiny_sd15():
    torch.manual_seed(1)
    model = comfy.supported_models.SD15(dict(TINY_UNET)).get_model({})
    for p in model.parameters():
        p.data.normal_(0.0, 0.02)
    return comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)


def tiny_vae():
    torch.manual_seed(3)
    logging.disable(logging.WARNING)  # "Missing VAE keys": the weights are set just below
    try:
        vae = comfy.sd.VAE(sd={}, config={"params": {"ddconfig": TINY_VAE, "embed_dim": 4}})
    finally:
        logging.disable(logging.NOTSET)
    for p in vae.first_stage_model.parameters():
        p.data.normal_(0.0, 0.05)
    return vae


def sample(model):
    g = torch.Generator().manual_seed(2)
    pos, neg = [[torch.randn(1, 7, 32, generator=g), {}]], [[torch.randn(1, 5, 32, generator=g), {}]]
    latent = {"samples": torch.zeros(1, 4, 8, 8)}
    return nodes.common_ksampler(model, 3, 1, 2.5, "euler", "normal", pos, neg, latent)[0]["samples"]


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def run_node(model, vae=None, **kw):
    inputs = dict(width=64, height=64, batch_size=1, steps=1, rounds=2, memory_cap="")
    inputs.update(kw)
    updates = []
    saved = comfy.utils.PROGRESS_BAR_HOOK
    comfy.utils.set_progress_bar_global_hook(lambda value, total, preview, node_id=None: updates.append((value, total)))
    try:
        out = node_class()().measure(model, vae=vae, **inputs)
    finally:
        comfy.utils.set_progress_bar_global_hook(saved)
    return out, updates


@case
def node_is_loaded():
    """ComfyUI's loader registers the node with its display name, inputs and outputs."""
    cls = node_class()
    check(cls is sqc.SubquadWhichAttention, f"ComfyUI loaded {cls}")
    check(nodes.NODE_DISPLAY_NAME_MAPPINGS.get("SubquadWhichAttention") == "Which attention? (subquad)", "display name")
    types_ = cls.INPUT_TYPES()
    check(set(types_["required"]) >= {"model", "width", "height", "batch_size", "steps"}, f"inputs {types_}")
    check(set(types_["optional"]) == {"vae", "memory_cap"}, f"optional inputs {types_['optional']}")
    check(cls.RETURN_TYPES == ("IMAGE", "STRING", "MODEL"), f"outputs {cls.RETURN_TYPES}")


@case
def node_runs():
    """On a tiny SD1.5-config model and VAE: a chart IMAGE, a table naming every candidate with time
    and memory, a MODEL clone running the recommended attention; the inputs untouched."""
    model, vae = tiny_sd15(), tiny_vae()
    base = sample(model)
    (image, text, out), updates = run_node(model, vae)
    check(image.ndim == 4 and image.shape[0] == 1 and image.shape[-1] == 3, f"IMAGE shape {tuple(image.shape)}")
    check(image.dtype == torch.float32 and 0.0 <= image.min() and image.max() <= 1.0, "IMAGE not float in 0..1")
    check(image.shape[1] > 200 and image.shape[2] > 400 and image.std() > 0.01, f"a blank chart {tuple(image.shape)}")
    offered = [n for n in attn.REGISTERED_ATTENTION_FUNCTIONS if n != "subquad"]
    check({"pytorch", "sub_quad", "split"} <= set(offered), f"the registry: {offered}")
    for name in offered + ["subquad"]:
        lines = [ln for ln in text.splitlines() if ln.strip().startswith(name + " ") or ln.strip().startswith(name)]
        check(lines, f"the table does not name {name}:\n{text}")
        check(any((" ms " in ln or " s " in ln) and "iB" in ln for ln in lines), f"{name}: no time/memory:\n{text}")
    check("VAE decode" in text and "sub_quad (ComfyUI's now)" in text, f"no VAE part or no 'now':\n{text}")
    check("recommended:" in text, text)
    check(
        out is not model and "optimized_attention_override" not in model.model_options.get("transformer_options", {}),
        "original changed",
    )
    override = out.model_options["transformer_options"]["optimized_attention_override"]
    best = next(ln for ln in text.splitlines() if ln.startswith("recommended: ")).split()[1].rstrip(",")
    check(
        best in repr(override) or best in getattr(override, "name", ""), f"MODEL runs {override!r}, table says {best}"
    )
    check(updates and updates[-1][0] == updates[-1][1], f"progress bar: {updates[-3:]}")
    check(not vae.patcher.object_patches, "the VAE that came in got patches")
    patched = sample(out)
    check(rel(patched, base) < 1e-4, f"the MODEL vs ComfyUI's own attention: {rel(patched, base):.3g}")
    check(torch.equal(sample(model), base), "the original model's result changed")
    return {"table": text, "image": list(image.shape), "relative_difference": rel(patched, base)}


@case
def failing_candidates_are_reported():
    """A registered attention that raises, or runs out of memory, is a row saying so; the node goes on."""

    def broken(*args, **kwargs):
        raise RuntimeError("this attention is broken")

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    attn.REGISTERED_ATTENTION_FUNCTIONS.update(broken=broken, hungry=oom)
    try:
        (_, text, out), _ = run_node(tiny_sd15(), rounds=1, memory_cap="1GiB")
    finally:
        del attn.REGISTERED_ATTENTION_FUNCTIONS["broken"], attn.REGISTERED_ATTENTION_FUNCTIONS["hungry"]
    check("step, broken: error: RuntimeError: this attention is broken" in text, text)
    check("step, hungry: out of memory" in text, text)
    check("subquad, budget 1GiB" in text and "memory cap: 1.0 GiB" in text, text)
    override = out.model_options["transformer_options"]["optimized_attention_override"]
    check(getattr(override, "name", "") not in ("broken", "hungry"), f"recommended a failing one: {override!r}")
    return {"table": text}


@case
def interrupted_leaves_the_model():
    """Cancelling in ComfyUI (its interrupt flag) stops the node; the model that came in is unchanged."""
    model = tiny_sd15()
    before = (dict(model.model_options), len(model.patches), len(model.object_patches))
    comfy.model_management.interrupt_current_processing(True)
    try:
        run_node(model)
        raise AssertionError("the node did not stop on ComfyUI's interrupt")
    except comfy.model_management.InterruptProcessingException:
        pass
    finally:
        comfy.model_management.interrupt_current_processing(False)
    check((dict(model.model_options), len(model.patches), len(model.object_patches)) == before, "the model changed")


@case
def bad_cap_is_refused():
    """A memory_cap that is not a size: refused before anything runs, naming the input."""
    try:
        node_class()().measure(tiny_sd15(), memory_cap="lots")
        raise AssertionError("memory_cap='lots' was accepted")
    except ValueError as e:
        check(str(e).startswith("memory_cap: expected bytes or a size"), str(e))


if __name__ == "__main__":
    WORKER.main(sys.argv[2:])
