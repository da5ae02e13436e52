# ruff: noqa: I001  (the imports follow the web UI's start order, which matters)
"""The AUTOMATIC1111 checks of subquad.integrations.a1111, run in one process against the real web UI code.

tests/test_hosts_a1111.py runs this file as a subprocess (``python tests/_a1111_cases.py WEBUI
case...``) because importing A1111 puts a top-level ``modules`` package, ``ldm`` and ``sgm`` into
``sys.modules`` and patches torch (``modules.safe``): nothing of that may leak into other tests.
Each case prints one JSON line (tests/_host_snapshots.py: ``Worker``); a third-party package the
web UI needs and this Python lacks (``.ci/host-requirements.txt``) prints a skip line instead.

``WEBUI`` is an extracted stable-diffusion-webui snapshot with ``ldm`` and ``sgm`` laid out as
A1111's installer lays them out (``repositories/stable-diffusion-stability-ai/ldm``,
``repositories/generative-models/sgm``). The web UI starts as its ``initialize.imports()`` does:
``modules.paths`` puts ldm and sgm on the path, the real ``modules.shared`` is initialized by
``shared_init.initialize()`` (the real settings and command-line defaults), then ``sd_models``
pulls in ``sd_hijack``, ``sd_hijack_optimizations``, ``script_callbacks`` and the hypernetworks.

Stand-ins (empty modules whose every attribute is a do-nothing class), for third-party packages
only and none on the attention path: ``gradio`` and ``fastapi`` (the web UI), ``torchvision``
(the wheel on the index is a CUDA build that does not load beside the CPU torch), and the model-zoo
and image libraries the UI imports for other features: ``k_diffusion`` (samplers; A1111 clones it,
it is not in the snapshots), ``open_clip``/``transformers`` (text encoders; A1111 pins
transformers 4.30), ``kornia``, ``pytorch_lightning``, ``timm``, ``cv2``, ``skimage``,
``pillow_avif``. ``xformers`` is hidden, as on the CPUs and Macs this integration is for. The case
``real_code`` checks that every module under test comes from the snapshot.
"""

from __future__ import annotations

import contextlib
import html
import importlib.abc
import importlib.machinery
import io
import os
import sys
import types
from typing import Any, Callable, ClassVar, Dict

from _host_snapshots import Worker, close

WEBUI = os.path.realpath(sys.argv[1])
SELECTED = sys.argv[2:]
sys.argv = [sys.argv[0]]  # A1111 parses sys.argv (shared_cmd_options): give it a plain start
WORKER = Worker("AUTOMATIC1111", WEBUI, own=["modules", "ldm", "sgm"])
case = WORKER.case
os.environ.pop("COMMANDLINE_ARGS", None)

STAND_INS = frozenset(
    [
        "gradio",
        "fastapi",
        "torchvision",
        "k_diffusion",
        "open_clip",
        "transformers",
        "kornia",
        "pytorch_lightning",
        "timm",
        "cv2",
        "skimage",
        "pillow_avif",
    ]
)
HIDDEN = frozenset(["xformers"])


class _AnyMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        made = _AnyMeta(name, (_Any,), {})
        setattr(cls, name, made)
        return made


class _Any(metaclass=_AnyMeta):
    """Whatever a stand-in is asked for: a class that can be called, subclassed and read from."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Any()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Any()


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        made = _AnyMeta(name, (_Any,), {})
        setattr(self, name, made)
        return made


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    made: ClassVar[list] = []

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        top = name.split(".")[0]
        if top in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden from the A1111 checks)", name=name)
        if top not in STAND_INS:
            return None
        self.made.append(name)
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: Any) -> Any:
        module = _StandIn(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: Any) -> None:
        pass


sys.meta_path.insert(0, _Finder())
os.chdir(WEBUI)
sys.path.insert(0, WEBUI)

import torch  # noqa: E402

with WORKER.imports():  # a package of .ci/host-requirements.txt missing here: one skip line, the end
    # The web UI's start, in the order of modules/initialize.py imports().
    from modules import errors, import_hook, paths, timer  # noqa: F401

    import ldm.modules.attention
    import ldm.modules.diffusionmodules.model
    import ldm.modules.encoders.modules
    import sgm.modules.attention
    import sgm.modules.diffusionmodules.model
    import sgm.modules.encoders.modules

    # The libraries' own forwards, before A1111 touches them: the references the cases compare with.
    LDM_CROSS = ldm.modules.attention.CrossAttention.forward
    LDM_ATTNBLOCK = ldm.modules.diffusionmodules.model.AttnBlock.forward
    SGM_CROSS = sgm.modules.attention.CrossAttention.forward
    SGM_ATTNBLOCK = sgm.modules.diffusionmodules.model.AttnBlock.forward

    from modules import shared_init

    shared_init.initialize()

    from modules import sd_models  # noqa: F401
    from modules import (
        extensions,
        script_callbacks,
        script_loading,
        sd_hijack,
        sd_hijack_optimizations,
        shared,
    )
    from modules.hypernetworks import hypernetwork

import subquad  # noqa: E402
from subquad.integrations import a1111  # noqa: E402

# As modules/initialize.py does, before the extensions' scripts load.
script_callbacks.on_list_optimizers(sd_hijack_optimizations.list_optimizers)

GEN = torch.Generator().manual_seed(28)


def randn(*shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN, dtype=torch.float64).to(dtype)


def with_forward(cls: Any, forward: Any, module: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``module(*args)`` with ``cls.forward`` set to ``forward`` for the call (restored after).

    ldm's own CrossAttention computes its scores in float32 (``_ATTN_PRECISION``), which fails for
    float64 modules; for those it computes in the module's dtype here.
    """
    saved, precision = cls.forward, ldm.modules.attention._ATTN_PRECISION
    cls.forward = forward
    if args[0].dtype == torch.float64:
        ldm.modules.attention._ATTN_PRECISION = "native"
    try:
        with torch.no_grad():
            return module(*args, **kwargs)
    finally:
        cls.forward, ldm.modules.attention._ATTN_PRECISION = saved, precision


_LOADED: Dict[str, Any] = {}


def load_extension() -> Any:
    """``subquad install a1111`` into the snapshot, then the extension's script loaded as the web UI loads it (once)."""
    if "folder" not in _LOADED:
        _LOADED["folder"] = folder = a1111.install(WEBUI)
        extensions.list_extensions()
        # what modules.scripts.load_scripts() does for each script of each extension
        script_loading.load_module(os.path.join(str(folder), "scripts", "subquad_optimization.py"))
    return _LOADED["folder"]


def subquad_optimization() -> Any:
    load_extension()
    sd_hijack.list_optimizers()
    found = [o for o in sd_hijack.optimizers if o.name == "subquad"]
    assert found, f"subquad is not among A1111's optimizers: {[o.name for o in sd_hijack.optimizers]}"
    return found[0]


class Spy:
    """Records the calls of ``subquad.attention`` (the integration calls it by module attribute)."""

    def __init__(self) -> None:
        self.calls: list = []
        self.inputs: list = []
        self.original = subquad.attention

    def __enter__(self) -> "Spy":
        def spy(q: Any, k: Any, v: Any, **kw: Any) -> Any:
            self.calls.append(dict(dtypes=(q.dtype, k.dtype, v.dtype), **kw))
            out = self.original(q, k, v, **kw)
            self.inputs.append((q, k, v, out))
            return out

        subquad.attention = spy
        return self

    def __exit__(self, *exc: Any) -> None:
        subquad.attention = self.original


# --------------------------------------------------------------------------------------------


@case
def real_code() -> str:
    """The code under test is the snapshot's; the stand-ins are third-party packages only."""
    for module in (
        sd_hijack_optimizations,
        sd_hijack,
        script_callbacks,
        hypernetwork,
        shared,
        ldm.modules.attention,
        ldm.modules.diffusionmodules.model,
        sgm.modules.attention,
        sgm.modules.diffusionmodules.model,
    ):
        where = os.path.realpath(module.__file__)
        assert where.startswith(os.path.realpath(WEBUI) + os.sep), (
            f"{module.__name__} comes from {where}, not the snapshot"
        )
    tops = sorted({name.split(".")[0] for name in _Finder.made})
    assert set(tops) <= STAND_INS, tops
    assert not {"modules", "ldm", "sgm", "torch", "subquad", "einops"} & set(tops), tops
    assert type(shared.opts).__module__ == "modules.options", type(shared.opts)
    return f"stand-ins used: {', '.join(tops)}"


@case
def registers_through_callbacks() -> str:
    """install() writes the extension; A1111's loader runs its script; A1111's list_optimizers lists subquad."""
    folder = load_extension()
    ours = [e for e in extensions.extensions if e.name == "subquad"]
    assert ours and os.path.realpath(ours[0].path) == os.path.realpath(folder), [e.name for e in extensions.extensions]
    names = [c.name for c in script_callbacks.callback_map["callbacks_list_optimizers"]]
    assert "subquad/subquad_optimization.py/list_optimizers" in names, names
    opt = subquad_optimization()
    assert isinstance(opt, sd_hijack_optimizations.SdOptimization), type(opt).__mro__
    assert opt.title() == a1111.TITLE, opt.title()
    assert opt.cmd_opt is None and opt.is_available()
    assert sd_hijack.optimizers[-1] is opt, [o.name for o in sd_hijack.optimizers]  # lowest priority: last
    from modules import shared_items

    assert a1111.TITLE in shared_items.cross_attention_optimizations()
    return f"A1111 lists: {[o.name for o in sd_hijack.optimizers]}; callbacks: {names}"


@case
def automatic_never_picks_subquad() -> str:
    """A1111's own choice (sd_hijack.apply_optimizations) on "Automatic" never picks subquad; choosing it does."""
    subquad_optimization()
    picked = {}
    saved_device = shared.device
    try:
        for device in ("cpu", "mps", "cuda"):
            shared.device = torch.device(device)  # the built-ins' priorities read shared.device.type
            sd_hijack.list_optimizers()
            builtins = [o for o in sd_hijack.optimizers if o.name != "subquad"]
            assert all(a1111.PRIORITY < o.priority for o in builtins), [(o.name, o.priority) for o in builtins]
            shared.opts.cross_attention_optimization = "Automatic"
            picked[device] = sd_hijack.apply_optimizations()
            assert picked[device] != "subquad", picked
            assert ldm.modules.attention.CrossAttention.forward is not a1111.cross_attention_forward
    finally:
        shared.device = saved_device
        sd_hijack.list_optimizers()
    shared.opts.cross_attention_optimization = a1111.TITLE
    chosen = sd_hijack.apply_optimizations()
    assert chosen == "subquad", chosen
    assert ldm.modules.attention.CrossAttention.forward is a1111.cross_attention_forward
    assert sgm.modules.attention.CrossAttention.forward is a1111.sgm_cross_attention_forward
    assert ldm.modules.diffusionmodules.model.AttnBlock.forward is a1111.attnblock_forward
    assert sgm.modules.diffusionmodules.model.AttnBlock.forward is a1111.attnblock_forward
    shared.opts.cross_attention_optimization = "Automatic"
    sd_hijack.apply_optimizations()
    return f"Automatic picked {picked}; the title picked subquad"


@case
def undo_restores_a1111_defaults() -> str:
    """undo() is A1111's own: it puts back A1111's defaults, the very objects; switching to sdp replaces ours."""
    opt = subquad_optimization()
    assert type(opt).undo is sd_hijack_optimizations.SdOptimization.undo
    opt.apply()
    assert ldm.modules.attention.CrossAttention.forward is a1111.cross_attention_forward
    assert sgm.modules.attention.CrossAttention.forward is a1111.sgm_cross_attention_forward
    assert sgm.modules.diffusionmodules.model.AttnBlock.forward is a1111.attnblock_forward
    opt.undo()
    after = (
        ldm.modules.attention.CrossAttention.forward,
        ldm.modules.diffusionmodules.model.AttnBlock.forward,
        sgm.modules.attention.CrossAttention.forward,
        sgm.modules.diffusionmodules.model.AttnBlock.forward,
    )
    want = (
        hypernetwork.attention_CrossAttention_forward,
        LDM_ATTNBLOCK,
        hypernetwork.attention_CrossAttention_forward,
        SGM_ATTNBLOCK,
    )
    assert all(a is b for a, b in zip(after, want)), (after, want)
    sd_hijack.apply_optimizations(a1111.TITLE)
    assert sd_hijack.apply_optimizations("sdp - scaled dot product") == "sdp"
    assert ldm.modules.attention.CrossAttention.forward is sd_hijack_optimizations.scaled_dot_product_attention_forward
    assert sgm.modules.diffusionmodules.model.AttnBlock.forward is sd_hijack_optimizations.sdp_attnblock_forward
    sd_hijack.undo_optimizations()
    return "undo(): A1111's hypernetwork-aware CrossAttention.forward and each library's own AttnBlock.forward"


def cross_attention(cls: Any, ours: Any, original: Any, context: bool, **kw: Any) -> str:
    """Real ``cls`` with random weights: ours vs the library's own forward, float64 and float32."""
    torch.manual_seed(1)
    module = cls(query_dim=40, context_dim=24 if context else None, heads=3, dim_head=13).double().eval()
    x = randn(2, 113, 40)
    ctx = randn(2, 77, 24) if context else None
    golden = with_forward(cls, original, module, x, context=ctx, **kw)
    got64 = with_forward(cls, ours, module, x, context=ctx, **kw)
    assert (got64 - golden).abs().max().item() < 1e-12, (got64 - golden).abs().max().item()
    module32 = module.float()
    x32 = x.float()
    ctx32 = ctx.float() if ctx is not None else None
    kw32 = {k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    ref = with_forward(cls, original, module32, x32, context=ctx32, **kw32)
    got = with_forward(cls, ours, module32, x32, context=ctx32, **kw32)
    assert got.dtype == ref.dtype, f"{cls.__module__}: dtype {got.dtype}, the reference has {ref.dtype}"
    return close(cls.__module__, got, ref, golden, fudge=2.0)


@case
def ldm_cross_attention_self() -> str:
    return cross_attention(
        ldm.modules.attention.CrossAttention, a1111.cross_attention_forward, LDM_CROSS, context=False
    )


@case
def ldm_cross_attention_context() -> str:
    return cross_attention(ldm.modules.attention.CrossAttention, a1111.cross_attention_forward, LDM_CROSS, context=True)


@case
def sgm_cross_attention_self() -> str:
    return cross_attention(
        sgm.modules.attention.CrossAttention, a1111.sgm_cross_attention_forward, SGM_CROSS, context=False
    )


@case
def sgm_cross_attention_context() -> str:
    return cross_attention(
        sgm.modules.attention.CrossAttention, a1111.sgm_cross_attention_forward, SGM_CROSS, context=True
    )


@case
def ldm_key_mask() -> str:
    """ldm reads a mask (B, ...) as a key mask, True = attend."""
    mask = torch.rand(2, 7, 11, generator=GEN) > 0.3  # flattens to (2, 77)
    mask[:, 0, 0] = True
    return cross_attention(
        ldm.modules.attention.CrossAttention, a1111.cross_attention_forward, LDM_CROSS, context=True, mask=mask
    )


@case
def sgm_masks() -> str:
    """sgm passes its mask to SDPA: bool (True = attend) and float (added), broadcast to (B, H, Lq, Lk)."""
    keep = torch.rand(2, 1, 113, 77, generator=GEN) > 0.3
    keep[..., 0] = True
    out = [
        cross_attention(
            sgm.modules.attention.CrossAttention, a1111.sgm_cross_attention_forward, SGM_CROSS, context=True, mask=keep
        )
    ]
    bias = randn(1, 3, 113, 77)
    out.append(
        cross_attention(
            sgm.modules.attention.CrossAttention, a1111.sgm_cross_attention_forward, SGM_CROSS, context=True, mask=bias
        )
    )
    return "; ".join(out)


@case
def sgm_additional_tokens_and_crossframe() -> str:
    """sgm's extra keywords: tokens prepended then dropped; every group of n frames reads its first frame's keys."""
    cls = sgm.modules.attention.CrossAttention
    torch.manual_seed(2)
    module = cls(query_dim=40, heads=3, dim_head=13).double().eval()
    x = randn(4, 50, 40)
    extra = randn(4, 5, 40)
    kw = dict(additional_tokens=extra, n_times_crossframe_attn_in_self=2)
    golden = with_forward(cls, SGM_CROSS, module, x, **kw)
    got = with_forward(cls, a1111.sgm_cross_attention_forward, module, x, **kw)
    assert got.shape == (4, 50, 40), got.shape
    err = (got - golden).abs().max().item()
    assert err < 1e-12, err
    return f"float64 error {err:.2g}"


def attnblock(cls: Any, original: Any) -> str:
    torch.manual_seed(3)
    module = cls(64).double().eval()
    x = randn(2, 64, 9, 13)
    golden = with_forward(cls, original, module, x)
    got64 = with_forward(cls, a1111.attnblock_forward, module, x)
    assert (got64 - golden).abs().max().item() < 1e-12, (got64 - golden).abs().max().item()
    module32 = module.float()
    ref = with_forward(cls, original, module32, x.float())
    got = with_forward(cls, a1111.attnblock_forward, module32, x.float())
    assert got.dtype == ref.dtype, f"{cls.__module__}: dtype {got.dtype}, the reference has {ref.dtype}"
    return close(cls.__module__, got, ref, golden, fudge=2.0)


@case
def ldm_attnblock() -> str:
    return attnblock(ldm.modules.diffusionmodules.model.AttnBlock, LDM_ATTNBLOCK)


@case
def sgm_attnblock() -> str:
    return attnblock(sgm.modules.diffusionmodules.model.AttnBlock, SGM_ATTNBLOCK)


@case
def hypernetwork_applied() -> str:
    """A real A1111 Hypernetwork in shared.loaded_hypernetworks changes k and v as A1111's own forward does."""
    cls = ldm.modules.attention.CrossAttention
    torch.manual_seed(4)
    module = cls(query_dim=40, context_dim=24, heads=3, dim_head=13).eval()
    x, ctx = randn(2, 64, 40, dtype=torch.float32), randn(2, 77, 24, dtype=torch.float32)
    plain = with_forward(cls, a1111.cross_attention_forward, module, x, context=ctx)
    net = hypernetwork.Hypernetwork(
        name="check", enable_sizes=[24], layer_structure=[1, 2, 1], activation_func="relu", weight_init="XavierNormal"
    )
    shared.loaded_hypernetworks[:] = [net]
    try:
        a1111_own = with_forward(cls, hypernetwork.attention_CrossAttention_forward, module, x, context=ctx)
        ours = with_forward(cls, a1111.cross_attention_forward, module, x, context=ctx)
        a1111_sdp = with_forward(
            cls, sd_hijack_optimizations.scaled_dot_product_attention_forward, module, x, context=ctx
        )
    finally:
        shared.loaded_hypernetworks.clear()
    changed = (a1111_own - plain).abs().max().item()
    assert changed > 1e-2, f"the hypernetwork changed the output by only {changed:.3g}: the check could not fail"
    err = (ours - a1111_own).abs().max().item()
    assert err < 1e-5, f"with the hypernetwork, subquad differs from A1111's own forward by {err:.3g}"
    assert (ours - a1111_sdp).abs().max().item() < 1e-5
    return f"the hypernetwork moves the output by {changed:.3g}; subquad matches A1111's forward to {err:.2g}"


@case
def upcast_attn_honoured() -> str:
    """opts.upcast_attn: float32 q/k/v reach subquad, the output keeps the input dtype; fp16 overflow stays finite.

    The raw fp16 products q·k overflow here (A1111's own "V1" optimization gives non-finite output
    without the upcast). Accuracy is checked on the q, k, v that reached subquad: its output
    against float64 attention of those same tensors, with torch's SDPA in float32 (A1111's "sdp"
    with the upcast) as the same-precision reference.
    """
    cls = ldm.modules.attention.CrossAttention
    torch.manual_seed(5)
    x64 = randn(2, 70, 40) * 100.0
    notes = []
    for dtype in (torch.float16, torch.bfloat16):
        module = cls(query_dim=40, heads=2, dim_head=20).eval().to(dtype)
        x = x64.to(dtype)
        if dtype == torch.float16:
            v1 = with_forward(cls, sd_hijack_optimizations.split_cross_attention_forward_v1, module, x)
            bad = int((~torch.isfinite(v1)).sum())
            assert bad, "A1111's V1 gave finite fp16 output: the case does not overflow, it could not fail"
            notes.append(f"A1111's V1 without upcast: {bad} non-finite")
        for upcast in (False, True):
            shared.opts.upcast_attn = upcast
            try:
                with Spy() as spy:
                    got = with_forward(cls, a1111.cross_attention_forward, module, x)
            finally:
                shared.opts.upcast_attn = False
            want = torch.float32 if upcast else dtype
            assert len(spy.calls) == 1 and spy.calls[0]["dtypes"] == (want,) * 3, spy.calls
            assert got.dtype == dtype and torch.isfinite(got).all(), (got.dtype, int((~torch.isfinite(got)).sum()))
            q, k, v, out = spy.inputs[0]
            golden = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
            ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(out.dtype)
            notes.append(close(f"{dtype} upcast={upcast}", out, ref, golden, fudge=2.0))
    return "; ".join(notes)


@case
def budget_from_setting_and_env() -> str:
    """The setting, else SUBQUAD_MEMORY_BUDGET, reaches subquad.attention; a tiny budget is refused by subquad itself."""
    script_callbacks.ui_settings_callback()  # A1111 runs this while building Settings
    info = shared.opts.data_labels.get(a1111.SETTING)
    assert info is not None and info.section[0] == "optimizations", info
    cls = ldm.modules.attention.CrossAttention
    module = cls(query_dim=40, heads=2, dim_head=20).eval()
    x = randn(1, 64, 40, dtype=torch.float32)
    seen = {}
    try:
        for label, setting, env in (("none", "", None), ("env", "", "3MiB"), ("setting", "5MiB", "3MiB")):
            shared.opts.subquad_memory_budget = setting
            if env is None:
                os.environ.pop(a1111.ENV_BUDGET, None)
            else:
                os.environ[a1111.ENV_BUDGET] = env
            with Spy() as spy:
                with_forward(cls, a1111.cross_attention_forward, module, x)
            seen[label] = spy.calls[0]["memory_budget"]
        assert seen == {"none": None, "env": "3MiB", "setting": "5MiB"}, seen
        shared.opts.subquad_memory_budget = "lots"
        shown, console = refusal_as_a1111_shows_it(lambda: with_forward(cls, a1111.cross_attention_forward, module, x))
        shared.opts.subquad_memory_budget = "1KiB"
        try:
            with_forward(cls, a1111.cross_attention_forward, module, x)
            raise AssertionError("subquad ran a call in a 1 KiB budget: the budget did not reach it")
        except subquad.MemoryBudgetError as e:
            refused = str(e).splitlines()[0]
    finally:
        shared.opts.subquad_memory_budget = ""
        os.environ.pop(a1111.ENV_BUDGET, None)
    # the generation's error box names the setting, what would work and the value; the console's
    # traceback the public class
    want = f"subquad memory budget (Settings → Optimizations, {a1111.SETTING}): expected bytes or a size like '512MiB'"
    assert shown.startswith(f"ArgumentError: {want}") and shown.endswith("got 'lots'."), shown
    raised = [line.strip() for line in console.splitlines() if "ArgumentError" in line]
    assert raised and raised[-1].startswith(f"subquad.ArgumentError: {want}"), console
    return f"passed on: {seen}; 1KiB: {refused}; 'lots': {shown}"


def refusal_as_a1111_shows_it(generate: Callable[[], Any]) -> "tuple[str, str]":
    """What the web UI shows when ``generate`` raises: the text of the error box under the image
    (A1111's ``call_queue.wrap_gradio_call_no_job``), and the traceback it prints to the console."""
    from modules import call_queue

    console = io.StringIO()
    with contextlib.redirect_stderr(console):
        *_, box = call_queue.wrap_gradio_call_no_job(lambda: [generate()], extra_outputs=[None, ""])()
    assert box.startswith("<div class='error'>"), f"the generation did not fail: {box!r}"
    return html.unescape(box.removeprefix("<div class='error'>").removesuffix("</div>")), console.getvalue()


if __name__ == "__main__":
    WORKER.main(SELECTED)
