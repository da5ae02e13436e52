"""diffusers integration on tiny models built from config (random weights, nothing downloaded).

Golden: the same model in float64 with diffusers' own processor (AttnProcessor2_0 / AttnProcessor).
Under test: the model after ``enable(...)`` with subquad forced into many tiles.
"""

import sys
import types

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from diffusers import AutoencoderKL, UNet2DConditionModel  # noqa: E402
from diffusers.models.attention_processor import (  # noqa: E402
    Attention,
    AttnAddedKVProcessor2_0,
    AttnProcessor,
    AttnProcessor2_0,
)

from conftest import spy_sdpa_calls  # noqa: E402
from subquad.integrations import diffusers as sqd  # noqa: E402

MANY_TILES = (7, 5)


def _close(test, golden, *, tol=1e-10, what="output"):
    err = (test - golden).abs().max().item()
    scale = golden.abs().max().item() or 1.0
    assert err <= tol * scale, f"{what}: max abs error {err:.3e} > {tol:.1e} x {scale:.3e}"


def _unet():
    torch.manual_seed(0)
    return (
        UNet2DConditionModel(
            sample_size=16,
            in_channels=4,
            out_channels=4,
            layers_per_block=1,
            block_out_channels=(32, 64),
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=32,
            attention_head_dim=8,
            norm_num_groups=32,
        )
        .double()
        .eval()
    )


def _vae():
    torch.manual_seed(0)
    return (
        AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(32, 64),
            latent_channels=4,
            norm_num_groups=32,
            sample_size=32,
        )
        .double()
        .eval()
    )


def _unet_inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(2, 4, 16, 16, generator=g, dtype=torch.float64)
    text = torch.randn(2, 11, 32, generator=g, dtype=torch.float64)
    return sample, text


@pytest.fixture(scope="module")
def unet():
    return _unet()


def test_unet_self_and_cross_attention_match_default_processor(unet, monkeypatch):
    sample, text = _unet_inputs()
    unet.set_attn_processor(AttnProcessor2_0())
    with torch.no_grad():
        golden = unet(sample, 10, encoder_hidden_states=text).sample

    changed = sqd.enable(unet, chunk_size=MANY_TILES)
    assert len(changed) == 8, sorted(changed)
    assert {n.rsplit(".", 1)[-1] for n in changed} == {"attn1", "attn2"}
    assert all(isinstance(p, AttnProcessor2_0) for p in changed.values())
    calls = spy_sdpa_calls(monkeypatch)
    with torch.no_grad():
        out = unet(sample, 10, encoder_hidden_states=text).sample
    assert len(calls) == 8 and all(c["chunk_size"] == MANY_TILES for c in calls)
    _close(out, golden, what="UNet output")


def test_unet_encoder_attention_mask_matches_default_processor(unet):
    # diffusers turns a (B, Lk) keep-mask into a (B, 1, Lk) bias for every cross-attention.
    sample, text = _unet_inputs(seed=2)
    keep = torch.ones(2, 11)
    keep[0, 6:] = 0
    keep[1, :2] = 0
    unet.set_attn_processor(AttnProcessor2_0())
    with torch.no_grad():
        golden = unet(sample, 10, encoder_hidden_states=text, encoder_attention_mask=keep).sample
        sqd.enable(unet, chunk_size=MANY_TILES)
        out = unet(sample, 10, encoder_hidden_states=text, encoder_attention_mask=keep).sample
        unmasked = unet(sample, 10, encoder_hidden_states=text).sample
    _close(out, golden, what="UNet output with encoder_attention_mask")
    assert (out - unmasked).abs().max() > 1e-3, "the mask had no effect"


def test_unet_gradients_match(unet):
    sample, text = _unet_inputs(seed=3)
    unet.set_attn_processor(AttnProcessor2_0())
    unet.zero_grad()
    unet(sample, 10, encoder_hidden_states=text).sample.square().mean().backward()
    golden = {n: p.grad.clone() for n, p in unet.named_parameters() if "attn" in n}
    sqd.enable(unet, chunk_size=MANY_TILES)
    unet.zero_grad()
    unet(sample, 10, encoder_hidden_states=text).sample.square().mean().backward()
    for n, g in golden.items():
        _close(dict(unet.named_parameters())[n].grad, g, tol=1e-9, what=f"grad of {n}")


def test_vae_mid_block_attention_matches_default_processor():
    vae = _vae()
    image = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    with torch.no_grad():
        golden_latent = vae.encode(image).latent_dist.mean
        golden = vae.decode(golden_latent).sample
        changed = sqd.enable(vae, chunk_size=MANY_TILES)
        latent = vae.encode(image).latent_dist.mean
        out = vae.decode(latent).sample
    assert sorted(changed) == ["decoder.mid_block.attentions.0", "encoder.mid_block.attentions.0"]
    _close(latent, golden_latent, what="VAE latent")
    _close(out, golden, what="VAE reconstruction")


def test_enable_on_a_pipeline_prefixes_component_names():
    pipe = types.SimpleNamespace(components={"unet": _unet(), "vae": _vae(), "tokenizer": object(), "scheduler": None})
    changed = sqd.enable(pipe, memory_budget="64MiB")
    assert sum(n.startswith("unet.") for n in changed) == 8
    assert sum(n.startswith("vae.") for n in changed) == 2
    proc = pipe.components["unet"].get_submodule("mid_block.attentions.0.transformer_blocks.0.attn1").processor
    assert isinstance(proc, sqd.SubquadAttnProcessor) and proc.options == {"memory_budget": "64MiB"}


def test_scale_qk_false_uses_attn_scale():
    # Without scale_qk diffusers falls back to AttnProcessor (scores not scaled); so must we.
    torch.manual_seed(0)
    attn = Attention(query_dim=16, heads=2, dim_head=8, scale_qk=False).double()
    assert isinstance(attn.processor, AttnProcessor) and attn.scale == 1.0
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    with torch.no_grad():
        golden = attn(x)
        changed = sqd.enable(attn, chunk_size=MANY_TILES)
        out = attn(x)
    assert list(changed) == [""] and isinstance(changed[""], AttnProcessor)
    _close(out, golden, what="scale_qk=False")


def test_per_head_and_per_query_masks_match():
    torch.manual_seed(0)
    attn = Attention(query_dim=16, cross_attention_dim=12, heads=2, dim_head=8).double()
    x = torch.randn(3, 13, 16, dtype=torch.float64)
    ctx = torch.randn(3, 9, 12, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    masks = {
        "(B, 1, Lk)": torch.randn(3, 1, 9, generator=g, dtype=torch.float64),
        "(B, Lq, Lk)": torch.randn(3, 13, 9, generator=g, dtype=torch.float64),
        "(B*heads, Lq, Lk)": torch.randn(6, 13, 9, generator=g, dtype=torch.float64),
    }
    for name, mask in masks.items():
        attn.set_processor(AttnProcessor2_0())
        with torch.no_grad():
            golden = attn(x, encoder_hidden_states=ctx, attention_mask=mask)
            attn.set_processor(sqd.SubquadAttnProcessor(chunk_size=MANY_TILES))
            out = attn(x, encoder_hidden_states=ctx, attention_mask=mask)
        _close(out, golden, what=f"mask {name}")


def test_leaves_processors_it_cannot_replace():
    attn = Attention(query_dim=16, heads=2, dim_head=8, added_kv_proj_dim=12, processor=AttnAddedKVProcessor2_0())
    assert sqd.enable(attn) == {}
    assert isinstance(attn.processor, AttnAddedKVProcessor2_0)


def test_reenable_replaces_options(unet):
    sqd.enable(unet, chunk_size=MANY_TILES)
    changed = sqd.enable(unet, backend="matmul")
    assert len(changed) == 8
    assert all(isinstance(p, sqd.SubquadAttnProcessor) for p in changed.values())
    assert unet.mid_block.attentions[0].transformer_blocks[0].attn1.processor.options == {"backend": "matmul"}


def test_errors():
    with pytest.raises(TypeError, match=r"unexpected option.*'return_lse'"):
        sqd.SubquadAttnProcessor(return_lse=True)
    with pytest.raises(TypeError, match="diffusers pipeline"):
        sqd.enable(object())


def test_importing_the_package_does_not_import_hosts():
    code = (
        "import sys, subquad, subquad.integrations; "
        "assert 'diffusers' not in sys.modules and 'transformers' not in sys.modules, "
        "[m for m in sys.modules if m.startswith(('diffusers', 'transformers'))]"
    )
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True)
