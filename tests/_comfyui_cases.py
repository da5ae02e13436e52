"""The ComfyUI checks of subquad.integrations.comfyui, run in one child process against ComfyUI's real code.

``python tests/_comfyui_cases.py COMFYUI_ROOT [case ...]`` (run by tests/test_hosts_comfyui.py):
ComfyUI mutates global state when imported (its cli args, model management, ``sys.path``), so it
is imported here, never in the pytest process. Each case prints one JSON line
(tests/_host_snapshots.py: ``Worker``); a third-party package ComfyUI needs and this Python lacks
(``.ci/host-requirements.txt``) prints a skip line instead.

Only ``torchvision`` is a stand-in (the wheel on the index links CUDA and fails next to the CPU
build of torch; only the cascade/cosmos/ace model files import it). Attention, samplers, model
patcher, VAE and the custom-node loader are ComfyUI's own. Calls are counted by wrapping
``subquad.sdpa`` and ComfyUI's ``efficient_dot_product_attention`` (inside ``attention_sub_quad``,
its CPU default) and ``slice_attention`` (its CPU VAE default), so each case shows which code ran.
"""

from __future__ import annotations

import asyncio
import importlib.machinery
import logging
import os
import sys
import types

from _comfyui_models import TINY_UNET, TINY_VAE
from _host_snapshots import Worker, close

ROOT = os.path.abspath(sys.argv[1])
WORKER = Worker("ComfyUI", ROOT, own=["comfy", "comfy_extras", "comfy_api", "comfy_execution", "nodes"])
case = WORKER.case
FUDGE = 4.0  # vs ComfyUI's attention_pytorch: another order of the same float32 sums


def _torchvision_stand_in():
    tv = types.ModuleType("torchvision")
    tv.__path__ = []
    tv.__spec__ = importlib.machinery.ModuleSpec("torchvision", None, is_package=True)
    tr = types.ModuleType("torchvision.transforms")
    tr.__spec__ = importlib.machinery.ModuleSpec("torchvision.transforms", None)

    def missing(name):
        raise AttributeError(f"torchvision stand-in (tests/_comfyui_cases.py): no {name}")

    tr.__getattr__ = missing
    tv.transforms = tr
    sys.modules["torchvision"] = tv
    sys.modules["torchvision.transforms"] = tr


import torch  # noqa: E402

with WORKER.imports():  # a package of .ci/host-requirements.txt missing here: one skip line, the end
    _torchvision_stand_in()
    sys.path.insert(0, ROOT)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # a CPU-only torch: model_management raises without it
    comfy.cli_args.args.disable_xformers = True
    import comfy.clip_model  # text encoders: binds optimized_attention_for_device by name
    import comfy.ldm.flux.math as flux_math  # binds optimized_attention by name
    import comfy.ldm.modules.attention as attn
    import comfy.ldm.modules.diffusionmodules.model as vae_model
    import comfy.ldm.modules.diffusionmodules.openaimodel
    import comfy.model_management
    import comfy.model_patcher
    import comfy.sd
    import comfy.supported_models
    import nodes

import subquad  # noqa: E402
import subquad.integrations.comfyui as sqc  # noqa: E402
from subquad import MemoryBudgetError  # noqa: E402

logging.getLogger().setLevel(logging.ERROR)
torch.manual_seed(0)
CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# Counting which attention ran


class Count:
    def __init__(self):
        self.n = 0


SUBQUAD, SUB_QUAD, SLICE = Count(), Count(), Count()


def counted(counter, fn):
    def wrapper(*args, **kwargs):
        counter.n += 1
        return fn(*args, **kwargs)

    return wrapper


subquad.sdpa = counted(SUBQUAD, subquad.sdpa)  # the integration calls subquad.sdpa by attribute
attn.efficient_dot_product_attention = counted(SUB_QUAD, attn.efficient_dot_product_attention)
vae_model.slice_attention = counted(SLICE, vae_model.slice_attention)


def reset():
    SUBQUAD.n = SUB_QUAD.n = SLICE.n = 0


def check(cond, message):
    if not cond:
        raise AssertionError(message)


def golden(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False):
    """Float64 attention in ComfyUI's layouts, written out: softmax(q kᵀ / sqrt(D) + mask) v; a row
    that sees no key gives 0."""
    q, k, v = q.double(), k.double(), v.double()
    if not skip_reshape:
        q, k, v = (t.reshape(t.shape[0], t.shape[1], heads, -1).permute(0, 2, 1, 3) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        m = mask[None, None] if mask.ndim == 2 else mask[:, None] if mask.ndim == 3 else mask
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = p @ v
    if skip_output_reshape:
        return out
    return out.permute(0, 2, 1, 3).reshape(out.shape[0], out.shape[2], -1)


def qkv(b, lq, lk, heads, d, dtype=torch.float32, skip_reshape=False, scale=1.0):
    if skip_reshape:
        shapes = [(b, heads, lq, d), (b, heads, lk, d), (b, heads, lk, d)]
    else:
        shapes = [(b, lq, heads * d), (b, lk, heads * d), (b, lk, heads * d)]
    q, k, v = (torch.randn(s) for s in shapes)
    return (q * scale).to(dtype), (k * scale).to(dtype), v.to(dtype)


# ---------------------------------------------------------------------------------------------
# The attention function against ComfyUI's own


@case
def attention_layouts():
    """Every combination of skip_reshape / skip_output_reshape, awkward sizes, vs attention_pytorch."""
    for b, lq, lk, heads, d in [(2, 37, 53, 3, 11), (1, 1, 203, 5, 8), (3, 113, 7, 1, 59)]:
        for skip_reshape in (False, True):
            for skip_out in (False, True):
                q, k, v = qkv(b, lq, lk, heads, d, skip_reshape=skip_reshape)
                kw = dict(skip_reshape=skip_reshape, skip_output_reshape=skip_out)
                ours = sqc.attention(q, k, v, heads, **kw)
                theirs = attn.attention_pytorch(q, k, v, heads, **kw)
                close(f"{b}x{lq}x{lk} heads={heads} D={d} {kw}", ours, theirs, golden(q, k, v, heads, **kw), FUDGE)
    # value with its own head dim (ComfyUI's own functions assume D == Dv; subquad does not)
    q, k, _ = qkv(2, 9, 17, 3, 8)
    v = torch.randn(2, 17, 3 * 5)
    ours = sqc.attention(q, k, v, 3)
    check(ours.shape == (2, 9, 15), f"Dv != D: output shape {tuple(ours.shape)}")
    close("Dv != D", ours, golden(q, k, v, 3).float(), golden(q, k, v, 3), fudge=0, floor=1e-5)
    # non-contiguous inputs (chunks of one projection, as VAEs and some DiTs pass them)
    qkv_ = torch.randn(2, 21, 3 * 24)
    q, k, v = qkv_.chunk(3, dim=-1)
    ours, theirs = sqc.attention(q, k, v, 4), attn.attention_pytorch(q, k, v, 4)
    close("chunked views", ours, theirs, golden(q, k, v, 4), FUDGE)


@case
def attention_masks():
    """2-D/3-D/4-D masks, bool and additive, with broadcast dims, as attention_pytorch reads them."""
    b, lq, lk, heads, d = 2, 29, 41, 3, 8
    for skip_reshape in (False, True):
        q, k, v = qkv(b, lq, lk, heads, d, skip_reshape=skip_reshape)
        shapes = {
            "2-D": (lq, lk),
            "3-D": (b, lq, lk),
            "3-D batch 1": (1, lq, lk),
            "3-D one query row": (b, 1, lk),
            "4-D": (b, heads, lq, lk),
            "4-D heads 1": (b, 1, lq, lk),
        }
        for kind in ("bool", "additive"):
            for label, shape in shapes.items():
                if kind == "bool":
                    mask = torch.rand(shape) > 0.4
                    mask[..., 0] = True  # every row sees a key: attention_pytorch's rows stay comparable
                else:
                    mask = torch.randn(shape) * 2
                    mask[torch.rand(shape) > 0.8] = float("-inf")
                    mask[..., 0] = 0.0
                kw = dict(skip_reshape=skip_reshape)
                name = f"{kind} {label} {tuple(shape)} skip_reshape={skip_reshape}"
                ours = sqc.attention(q, k, v, heads, mask=mask, **kw)
                theirs = attn.attention_pytorch(q, k, v, heads, mask=mask, **kw)
                close(name, ours, theirs, golden(q, k, v, heads, mask=mask, **kw), FUDGE)
    # a row that sees no key gives 0 (SDPA's convention), not NaN
    q, k, v = qkv(1, 4, 6, 2, 8)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[2] = False
    out = sqc.attention(q, k, v, 2, mask=mask)
    check(bool(torch.isfinite(out).all()) and out[0, 2].abs().max().item() == 0, f"fully masked row: {out[0, 2]}")


@case
def attention_fp16_overflow():
    """fp16 inputs whose q·kᵀ overflows fp16: finite and exact to fp16 rounding (ComfyUI's sub-quad without upcast is not)."""
    q, k, v = qkv(1, 64, 80, 2, 64, dtype=torch.float16, scale=90.0)
    raw = q.unflatten(-1, (2, -1)).transpose(1, 2) @ k.unflatten(-1, (2, -1)).transpose(1, 2).transpose(-1, -2)
    check(not bool(torch.isfinite(raw).all()), "the inputs were meant to overflow fp16 in q·kᵀ, and do not")
    gold = golden(q, k, v, 2)
    for precision in (None, torch.float32):
        out = sqc.attention(q, k, v, 2, attn_precision=precision)
        check(out.dtype == torch.float16, f"output dtype {out.dtype}")
        close(f"fp16 overflow attn_precision={precision}", out, gold.half(), gold, fudge=1.0, floor=2e-3)
    theirs = attn.attention_sub_quad(q, k, v, 2, attn_precision=None)  # what ComfyUI's CPU default gives
    return {"comfyui_sub_quad_finite": bool(torch.isfinite(theirs).all())}


@case
def attention_extra_kwargs():
    """transformer_options and whatever else ComfyUI passes are accepted and change nothing."""
    q, k, v = qkv(2, 13, 17, 2, 8)
    plain = sqc.attention(q, k, v, 2)
    extra = sqc.attention(
        q, k, v, 2, transformer_options={"block": ("input", 1)}, _inside_attn_wrapper=True, something_new=3
    )
    check(torch.equal(plain, extra), "extra keyword arguments changed the result")


@case
def attention_budget():
    """The budget reaches subquad: from the module setting, the environment, and a call's keyword."""
    q, k, v = qkv(1, 256, 256, 2, 32)
    try:
        sqc.attention(q, k, v, 2, memory_budget="1KiB")
        raise AssertionError("memory_budget='1KiB' did not reach subquad (no MemoryBudgetError)")
    except MemoryBudgetError:
        pass
    os.environ[sqc.ENV_BUDGET] = "1KiB"
    try:
        try:
            sqc.attention(q, k, v, 2)
            raise AssertionError(f"{sqc.ENV_BUDGET}=1KiB did not reach subquad")
        except MemoryBudgetError:
            pass
        os.environ[sqc.ENV_BUDGET] = "lots"
        try:
            sqc.attention(q, k, v, 2)
            raise AssertionError(f"{sqc.ENV_BUDGET}=lots was accepted")
        except ValueError as e:
            check(sqc.ENV_BUDGET in str(e), f"the message does not name the variable: {e}")
    finally:
        del os.environ[sqc.ENV_BUDGET]
    sqc.set_memory_budget("1KiB")
    try:
        try:
            sqc.attention(q, k, v, 2)
            raise AssertionError("set_memory_budget('1KiB') did not reach subquad")
        except MemoryBudgetError:
            pass
    finally:
        sqc.set_memory_budget(None)


@case
def registry():
    """register() puts "subquad" in ComfyUI's attention registry once; the entry computes attention."""
    found = sqc.register()
    check(found.registry and found.override and found.replace and found.vae, f"hooks found: {found}")
    check(found.version == "0.3.64", f"version {found.version!r}")
    fn = attn.get_attention_function("subquad")
    q, k, v = qkv(2, 11, 19, 2, 8)
    check(torch.equal(fn(q, k, v, 2), sqc.attention(q, k, v, 2)), "the registered function differs from attention()")
    warnings = []
    handler = logging.Handler()
    handler.emit = warnings.append
    logging.getLogger().addHandler(handler)
    try:
        sqc.register()
    finally:
        logging.getLogger().removeHandler(handler)
    check(not warnings, f"registering again logged: {[r.getMessage() for r in warnings]}")


# ---------------------------------------------------------------------------------------------
# The nodes, loaded by ComfyUI's own loader, sampling through its own common_ksampler

_LOADED = {}


def node_classes():
    """Install the node into the extracted ComfyUI and load it with ComfyUI's nodes.load_custom_node."""
    if not _LOADED:
        path = sqc.install(ROOT)
        check(asyncio.run(nodes.load_custom_node(str(path))), f"load_custom_node({path}) failed")
        _LOADED.update(nodes.NODE_CLASS_MAPPINGS)
    return _LOADED["SubquadModelAttention"], _LOADED["SubquadVAEAttention"]


def tiny_sd15():
    torch.manual_seed(1)
    model = comfy.supported_models.SD15(dict(TINY_UNET)).get_model({})
    for p in model.parameters():
        p.data.normal_(0.0, 0.02)
    return comfy.model_patcher.ModelPatcher(model, load_device=CPU, offload_device=CPU)


CONDS = None


def sample(model):
    global CONDS
    if CONDS is None:
        g = torch.Generator().manual_seed(2)
        CONDS = ([[torch.randn(1, 7, 32, generator=g), {}]], [[torch.randn(1, 5, 32, generator=g), {}]])
    latent = {"samples": torch.zeros(1, 4, 16, 16)}
    reset()
    out = nodes.common_ksampler(model, 3, 1, 2.5, "euler", "normal", CONDS[0], CONDS[1], latent)[0]["samples"]
    return out, SUBQUAD.n, SUB_QUAD.n


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@case
def model_node():
    """The MODEL node, loaded by ComfyUI: a clone whose every attention call runs in subquad; the original untouched."""
    model_cls, _ = node_classes()
    check(model_cls is sqc.SubquadModelAttention, f"ComfyUI loaded {model_cls}")
    model = tiny_sd15()
    base, n_subquad, n_default = sample(model)
    check(n_subquad == 0 and n_default > 0, f"unpatched: subquad {n_subquad} calls, ComfyUI sub-quad {n_default}")
    (patched,) = model_cls().patch(model, "")
    check(patched is not model, "the node returned the model it was given")
    check(
        "optimized_attention_override" not in model.model_options["transformer_options"],
        "the original model was changed",
    )
    out, n_sq, n_cq = sample(patched)
    check(n_sq == n_default and n_cq == 0, f"patched: subquad {n_sq} calls (expected {n_default}), sub-quad {n_cq}")
    check(rel(out, base) < 1e-4, f"patched vs ComfyUI's default: relative difference {rel(out, base):.3g}")
    again, n_sq2, n_cq2 = sample(model)
    check(n_sq2 == 0 and n_cq2 == n_default, f"original after patching: subquad {n_sq2}, sub-quad {n_cq2}")
    check(torch.equal(again, base), "the original model's result changed after patching")
    (budgeted,) = model_cls().patch(model, "64MiB")
    out64, n64, _ = sample(budgeted)
    check(n64 == n_default and rel(out64, base) < 1e-4, f"budget 64MiB: {n64} calls, rel {rel(out64, base):.3g}")
    (tight,) = model_cls().patch(model, "1KiB")
    try:
        sample(tight)
        raise AssertionError("a 1KiB budget from the node did not reach subquad")
    except MemoryBudgetError:
        pass
    shown = refusal_as_comfyui_shows_it(lambda: model_cls().patch(model, "lots"))
    _, vae_cls = node_classes()
    check(refusal_as_comfyui_shows_it(lambda: vae_cls().patch(None, "lots")) == shown, "the VAE node says otherwise")
    return {"attention_calls_per_step": n_default, "relative_difference": rel(out, base), "lots": shown}


def refusal_as_comfyui_shows_it(run_node):
    """The error a node raises as ComfyUI's error dialog shows it (execution.py: exception_type,
    exception_message): public names only, the input, the value, what would work."""
    import execution

    try:
        run_node()
    except Exception as e:
        shown = f"{execution.full_type_name(type(e))}: {e}"
    else:
        raise AssertionError("memory_budget='lots' was accepted by the node")
    want = "subquad.ArgumentError: memory_budget: expected bytes or a size like '512MiB' or '2GB'"
    check(shown.startswith(want) and shown.endswith("got 'lots'."), f"the dialog shows {shown!r}")
    return shown


@case
def model_node_replace_patches():
    """A ComfyUI without the override hook: attn1/attn2 replace patches on every transformer block."""
    model_cls, _ = node_classes()
    model = tiny_sd15()
    base, _, n_default = sample(model)
    saved = attn.wrap_attn
    del attn.wrap_attn
    try:
        (patched,) = model_cls().patch(model, "")
    finally:
        attn.wrap_attn = saved
    to = patched.model_options["transformer_options"]
    check("optimized_attention_override" not in to, "the override was used on a host said not to have it")
    blocks = [m for m in model.model.diffusion_model.modules() if type(m).__name__ == "BasicTransformerBlock"]
    for name in ("attn1", "attn2"):
        found = len(to.get("patches_replace", {}).get(name, {}))
        check(found == len(blocks), f"{name}: {found} replace patches for {len(blocks)} transformer blocks")
    out, n_sq, n_cq = sample(patched)
    check(n_sq == n_default and n_cq == 0, f"replace patches: subquad {n_sq} (expected {n_default}), sub-quad {n_cq}")
    check(rel(out, base) < 1e-4, f"replace patches vs default: relative difference {rel(out, base):.3g}")
    check("patches_replace" not in model.model_options["transformer_options"], "the original model was changed")


@case
def unsupported_host():
    """Without any hook the node says which ComfyUI it found and what it looked for."""
    model_cls, _ = node_classes()
    model = tiny_sd15()
    patcher_cls = comfy.model_patcher.ModelPatcher
    saved = attn.wrap_attn, patcher_cls.set_model_attn1_replace, patcher_cls.set_model_attn2_replace
    del attn.wrap_attn, patcher_cls.set_model_attn1_replace, patcher_cls.set_model_attn2_replace
    try:
        model_cls().patch(model, "")
        raise AssertionError("no error without any hook")
    except sqc.HostUnsupported as e:
        message = str(e)
        import execution

        shown = execution.full_type_name(type(e))  # the type ComfyUI's error dialog names
        check(shown == "subquad.integrations.comfyui.HostUnsupported", f"the dialog names {shown}")
    finally:
        attn.wrap_attn, patcher_cls.set_model_attn1_replace, patcher_cls.set_model_attn2_replace = saved
    for part in ("0.3.64", "optimized_attention_override", "set_model_attn1_replace"):
        check(part in message, f"the message lacks {part!r}: {message}")
    return {"message": message}


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


def decode(vae, latent):
    reset()
    return vae.decode(latent), SUBQUAD.n, SLICE.n


@case
def vae_node():
    """The VAE node: a copy whose AttnBlocks run in subquad; the original keeps ComfyUI's attention."""
    _, vae_cls = node_classes()
    vae = tiny_vae()
    latent = torch.randn(1, 4, 24, 20, generator=torch.Generator().manual_seed(4))
    base, n_sq, n_slice = decode(vae, latent)
    check(n_sq == 0 and n_slice == 1, f"unpatched decode: subquad {n_sq}, slice_attention {n_slice}")
    (patched,) = vae_cls().patch(vae, "256MiB")
    check(patched is not vae and patched.first_stage_model is vae.first_stage_model, "expected a copy sharing weights")
    check(not vae.patcher.object_patches, f"the original VAE got patches: {list(vae.patcher.object_patches)}")
    out, n_sq, n_slice = decode(patched, latent)
    check(n_sq == 1 and n_slice == 0, f"patched decode: subquad {n_sq}, slice_attention {n_slice}")
    check(rel(out, base) < 1e-4, f"patched vs default decode: relative difference {rel(out, base):.3g}")
    again, n_sq, n_slice = decode(vae, latent)  # ComfyUI swaps the loaded clone's object patches back
    check(n_sq == 0 and n_slice == 1 and torch.equal(again, base), "the original VAE after the copy ran changed")
    _, n_sq, n_slice = decode(patched, latent)
    check(n_sq == 1 and n_slice == 0, f"patched decode after the original: subquad {n_sq}, slice {n_slice}")
    reset()
    patched.encode(torch.rand(1, 48, 40, 3))
    check(SUBQUAD.n == 1 and SLICE.n == 0, f"patched encode: subquad {SUBQUAD.n}, slice {SLICE.n}")
    (tight,) = vae_cls().patch(vae, "1KiB")
    try:
        decode(tight, latent)
        raise AssertionError("a 1KiB budget from the VAE node did not reach subquad")
    except MemoryBudgetError:
        pass


@case
def mps_torch_2_12():
    """One SD1.5 step and a VAE decode through the node on a simulated Mac with torch 2.12: every
    attention call reaches torch's SDPA through subquad's MPS router (no explicit scale, no
    causal flag), and the results equal ComfyUI's default."""
    from subquad._backends import sdpa as sdpa_module
    from subquad._inputs import Inputs

    model_cls, vae_cls = node_classes()
    model = tiny_sd15()
    base, _, n_default = sample(model)
    vae = tiny_vae()
    latent = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(6))
    vae_base, _, _ = decode(vae, latent)
    calls = []
    real_sdpa, real_type, real_version = sdpa_module.TORCH_SDPA, Inputs.device_type, torch.__version__

    def record(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append((tuple(q.shape), tuple(v.shape), q.dtype, attn_mask is not None, is_causal, scale))
        return real_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)

    sdpa_module.TORCH_SDPA = record
    Inputs.device_type = property(lambda self: "mps")
    torch.__version__ = torch.torch_version.TorchVersion("2.12.1")
    subquad._fast.clear()  # plans remembered for the CPU cases above (a real tensor never changes device)
    try:
        (patched,) = model_cls().patch(model, "")
        out, n_sq, n_cq = sample(patched)
        (patched_vae,) = vae_cls().patch(vae, "")
        vae_out, n_vae, _ = decode(patched_vae, latent)
    finally:
        sdpa_module.TORCH_SDPA, Inputs.device_type, torch.__version__ = real_sdpa, real_type, real_version
        subquad._fast.clear()
    check(
        n_sq == n_default and n_cq == 0, f"simulated MPS: subquad {n_sq} calls (expected {n_default}), sub-quad {n_cq}"
    )
    check(n_vae == 1, f"simulated MPS VAE decode: subquad {n_vae} calls")
    check(len(calls) == n_default + 1, f"{len(calls)} calls reached torch's SDPA, expected {n_default + 1}")
    bad = [c for c in calls if c[5] is not None or c[4] or c[0][-1] != c[1][-1]]
    check(not bad, f"calls in a torch 2.12 MPS defect's condition (explicit scale, causal, Ev != E): {bad}")
    check(rel(out, base) < 1e-4, f"simulated MPS step vs ComfyUI's default: relative difference {rel(out, base):.3g}")
    check(
        rel(vae_out, vae_base) < 1e-4, f"simulated MPS VAE vs default: relative difference {rel(vae_out, vae_base):.3g}"
    )
    return {"calls": len(calls), "relative_difference": rel(out, base)}


@case
def default_mode():
    """SUBQUAD_COMFYUI_DEFAULT=1 when the node loads: every model and new VAE runs in subquad; disable_default() undoes it."""
    node_classes()
    original = attn.optimized_attention
    model = tiny_sd15()
    base, _, n_default = sample(model)
    vae = tiny_vae()
    latent = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(5))
    vae_base, _, _ = decode(vae, latent)
    os.environ[sqc.ENV_DEFAULT] = "1"
    try:
        check(asyncio.run(nodes.load_custom_node(os.path.join(ROOT, "custom_nodes", "subquad"))), "load failed")
    finally:
        del os.environ[sqc.ENV_DEFAULT]
    try:
        check(attn.optimized_attention is not original, "optimized_attention was not replaced")
        check(attn.optimized_attention.__wrapped__ is sqc.attention, "optimized_attention is not subquad's")
        check(flux_math.optimized_attention is attn.optimized_attention, "flux's bound name was missed")
        for_device = comfy.clip_model.optimized_attention_for_device
        check(for_device(CPU, small_input=True) is attn.optimized_attention, "text encoders were missed")
        out, n_sq, n_cq = sample(model)
        check(n_sq == n_default and n_cq == 0, f"default mode: subquad {n_sq} (expected {n_default}), sub-quad {n_cq}")
        check(rel(out, base) < 1e-4, f"default mode vs ComfyUI: relative difference {rel(out, base):.3g}")
        new_vae = tiny_vae()
        out, n_sq, n_slice = decode(new_vae, latent)
        check(n_sq == 1 and n_slice == 0, f"a VAE built in default mode: subquad {n_sq}, slice {n_slice}")
        check(rel(out, vae_base) < 1e-4, f"VAE in default mode: relative difference {rel(out, vae_base):.3g}")
    finally:
        restored = sqc.disable_default()
    check(attn.optimized_attention is original and flux_math.optimized_attention is original, "not restored")
    check(
        comfy.clip_model.optimized_attention_for_device is attn.optimized_attention_for_device,
        "text encoders not restored",
    )
    check(any(r.endswith(".vae_attention") for r in restored), f"vae_attention not restored: {restored}")
    _, n_sq, n_cq = sample(model)
    check(n_sq == 0 and n_cq == n_default, f"after disable_default: subquad {n_sq}, sub-quad {n_cq}")
    return {"rebound": len(restored)}


if __name__ == "__main__":
    WORKER.main(sys.argv[2:])
