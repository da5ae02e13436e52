"""Whole models for ``subquad bench --model``: their published configs, built with random weights
(nothing is downloaded), their inputs, and the step that is measured.

| name | what | size |
|---|---|---|
| ``sd15-unet`` | Stable Diffusion 1.5's ``UNet2DConditionModel`` config, cross-attention to 77x768 text states | ``--resolution`` px, latent 1/8 |
| ``sd-vae-decoder`` | SD's ``AutoencoderKL`` decoder (the mid-block attention runs over the whole latent) | ``--resolution`` px |
| ``llama-1b`` | Llama 3.2 1B's ``LlamaConfig`` (16 layers, 32 heads, 8 key/value heads) | ``--seq-len`` tokens |
| ``*-small`` | the same block structure with fewer channels or layers | |

diffusers and transformers are optional: they are imported when a model is built, and a
missing one raises :class:`MissingDependency` naming the extra to install. What the rest of the
package uses: ``MODELS``, ``ModelSpec``, ``MissingDependency``, ``check_size``, ``build``,
``make_inputs``, ``modes``, ``make_step``.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .cases import DTYPES  # noqa: F401 (the dtype names of --dtype, for the model's callers)

TEXT_TOKENS = 77  # CLIP's context length: SD 1.5's cross-attention keys
DECODE_TOKENS = 8  # tokens of the decode loop after a prefill


class MissingDependency(ImportError):
    """diffusers or transformers is not installed; the message says which extra installs it."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str  # "unet", "vae" or "llama"
    description: str
    config: dict = field(default_factory=dict)
    sizes: tuple[int, ...] = ()  # the default --resolution (px) or --seq-len (tokens)

    @property
    def library(self) -> str:
        return "transformers" if self.family == "llama" else "diffusers"

    @property
    def size_unit(self) -> str:
        return "tokens" if self.family == "llama" else "px"


_SD15_UNET = dict(
    sample_size=64,
    in_channels=4,
    out_channels=4,
    layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    cross_attention_dim=768,
    attention_head_dim=8,  # diffusers' name for 8 heads
    norm_num_groups=32,
)
_SD_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    layers_per_block=2,
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    norm_num_groups=32,
    sample_size=512,
)
_LLAMA_1B = dict(  # meta-llama/Llama-3.2-1B's config.json
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    hidden_act="silu",
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
    },
)

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "sd15-unet",
            "unet",
            "Stable Diffusion 1.5 UNet2DConditionModel (860M parameters), cross-attention to 77x768 text states",
            _SD15_UNET,
            (512,),
        ),
        ModelSpec(
            "sd15-unet-small",
            "unet",
            "sd15-unet's block structure with 64-256 channels and one layer per block",
            {**_SD15_UNET, "block_out_channels": (64, 128, 256, 256), "layers_per_block": 1},
            (256,),
        ),
        ModelSpec(
            "sd-vae-decoder",
            "vae",
            "Stable Diffusion's AutoencoderKL decoder (49M parameters); its mid-block attention spans the whole latent",
            _SD_VAE,
            (512,),
        ),
        ModelSpec(
            "sd-vae-decoder-small",
            "vae",
            "sd-vae-decoder's block structure with 32-128 channels and one layer per block",
            {**_SD_VAE, "block_out_channels": (32, 64, 128, 128), "layers_per_block": 1},
            (256,),
        ),
        ModelSpec(
            "llama-1b",
            "llama",
            "Llama 3.2 1B's config (1.2B parameters, grouped-query attention 32/8 heads of 64)",
            _LLAMA_1B,
            (2048,),
        ),
        ModelSpec(
            "llama-small",
            "llama",
            "a Llama-style decoder: 4 layers, hidden 256, 8 heads of 32 with 4 key/value heads, vocabulary 8192",
            dict(
                vocab_size=8192,
                hidden_size=256,
                intermediate_size=704,
                num_hidden_layers=4,
                num_attention_heads=8,
                num_key_value_heads=4,
                head_dim=32,
                max_position_embeddings=65536,
                rms_norm_eps=1e-5,
                rope_theta=10000.0,
                hidden_act="silu",
            ),
            (1024,),
        ),
    )
}

INSTALL = {"diffusers": "pip install 'subquad[diffusers]'", "transformers": "pip install 'subquad[transformers]'"}


def spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"Unknown model {name!r}; expected one of {', '.join(MODELS)}.")
    return MODELS[name]


def require(library: str) -> None:
    """Raise MissingDependency when ``library`` (diffusers, transformers) is not installed."""
    if importlib.util.find_spec(library) is None:
        raise MissingDependency(f"--model needs {library}, which is not installed: {INSTALL[library]}")


def check_size(spec: ModelSpec, size: int) -> Optional[str]:
    """Why ``size`` cannot be used for ``spec`` (None when it can)."""
    if spec.family == "llama":
        return None if size >= 1 else f"--seq-len must be positive, got {size}"
    if size < 8 or size % 8:
        below, above = size // 8 * 8, (size // 8 + 1) * 8
        example = f"{below} or {above}" if below >= 8 else "8, or 512 for SD 1.5's native size"
        return f"--resolution must be a positive multiple of 8 (the latent is 1/8 of it), got {size}; for example {example}"
    return None


def modes(spec: ModelSpec, task: str) -> tuple[str, ...]:
    """What one task measures: infer is one forward (a prefill and a decode loop for Llama);
    train is forward and backward of a loss, for the UNet both the LoRA-style step (only the
    attention projections require grad) and the full one."""
    if task == "infer":
        return ("prefill", "decode") if spec.family == "llama" else ("infer",)
    if task == "train":
        return ("train-lora", "train-full") if spec.family == "unet" else ("train",)
    raise ValueError(f"Unknown task {task!r}; expected infer or train.")


def build(
    spec: ModelSpec, *, device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
) -> torch.nn.Module:
    """The model with random weights drawn from ``seed`` (the same weights in every process)."""
    require(spec.library)
    torch.manual_seed(seed)
    if spec.family == "unet":
        from diffusers import UNet2DConditionModel  # optional dependency (subquad[diffusers])

        model = UNet2DConditionModel(**spec.config)
    elif spec.family == "vae":
        from diffusers import AutoencoderKL  # optional dependency (subquad[diffusers])

        model = AutoencoderKL(**spec.config)
        model.encoder = None  # only the decoder is measured; its weights would be dead memory
        model.quant_conv = None
    else:
        from transformers import LlamaConfig, LlamaForCausalLM  # optional dependency

        model = LlamaForCausalLM(LlamaConfig(**spec.config, attn_implementation="sdpa"))
    model = model.to(device=device) if dtype == torch.float32 else model.to(device=device, dtype=dtype)
    built: torch.nn.Module = model.eval()
    return built


def make_inputs(
    spec: ModelSpec,
    size: int,
    *,
    batch: int = 1,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 1,
) -> dict:
    """Random inputs of one step (drawn on the CPU so that every device sees the same)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    if spec.family == "unet":
        latent = size // 8
        return {
            "sample": randn(batch, 4, latent, latent),
            "timestep": torch.tensor(500, device=device),
            "text": randn(batch, TEXT_TOKENS, spec.config["cross_attention_dim"]),
            "target": randn(batch, 4, latent, latent),
        }
    if spec.family == "vae":
        latent = size // 8
        return {"latent": randn(batch, 4, latent, latent), "target": randn(batch, 3, size, size)}
    vocab = spec.config["vocab_size"]
    ids = torch.randint(0, vocab, (batch, size + DECODE_TOKENS), generator=gen).to(device)
    return {"ids": ids[:, :size], "next": ids[:, size:]}


def _set_trainable(model: torch.nn.Module, mode: str) -> None:
    """train-lora: only the attention projections (to_q, to_k, to_v, to_out.0) require grad, as
    in a LoRA/DreamBooth step; train/train-full: every parameter; inference: none."""
    lora = mode == "train-lora"
    for name, p in model.named_parameters():
        if mode.startswith("train"):
            p.requires_grad_(not lora or any(f".{k}." in f".{name}" for k in ("to_q", "to_k", "to_v", "to_out.0")))
        else:
            p.requires_grad_(False)


Step = Callable[[], torch.Tensor]


def make_step(spec: ModelSpec, model: Any, inputs: dict, mode: str) -> tuple[Optional[Step], Step]:
    """``(setup, step)`` of one mode: ``setup`` runs untimed before each step (the prefill
    whose cache a decode loop extends), ``step`` returns the model's output (detached) that is
    compared across implementations. Gradients are set to None before each training step, as
    ``zero_grad(set_to_none=True)`` does, and no optimizer runs (the weights stay the same)."""
    _set_trainable(model, mode)
    training = mode.startswith("train")
    params = [p for p in model.parameters() if p.requires_grad]

    def zero():
        for p in params:
            p.grad = None

    if spec.family == "unet":

        def forward():
            return model(inputs["sample"], inputs["timestep"], encoder_hidden_states=inputs["text"]).sample

        target = inputs["target"]
    elif spec.family == "vae":

        def forward():
            return model.decode(inputs["latent"]).sample

        target = inputs["target"]
    else:
        return _llama_step(model, inputs, mode, zero)

    if not training:

        def infer():
            with torch.no_grad():
                return forward()

        return None, infer

    def train():
        zero()
        out = forward()
        torch.nn.functional.mse_loss(out.float(), target.float()).backward()
        return out.detach()

    return None, train


def _llama_step(model: Any, inputs: dict, mode: str, zero: Callable[[], None]) -> tuple[Optional[Step], Step]:
    ids, nxt = inputs["ids"], inputs["next"]
    if mode == "train":

        def train():
            zero()
            out = model(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
            return out.logits.detach()

        return None, train
    if mode == "prefill":

        def prefill():
            with torch.no_grad():
                # As generate() does: logits of the last position only.
                return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits

        return None, prefill
    state: dict = {}
    # transformers 5 names the cache argument and output ``cache``; 4.x ``past_key_values``.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def setup():
        state.clear()
        with torch.no_grad():
            state["cache"] = getattr(model(input_ids=ids, use_cache=True, logits_to_keep=1), name)

    def decode():
        # Teacher-forced: the same tokens for every implementation, whatever their logits say.
        logits = []
        cache = state.pop("cache")
        with torch.no_grad():
            for i in range(nxt.shape[1]):
                out = model(input_ids=nxt[:, i : i + 1], use_cache=True, **{name: cache})
                cache = getattr(out, name)
                logits.append(out.logits[:, -1])
        return torch.stack(logits, 1)

    return setup, decode
