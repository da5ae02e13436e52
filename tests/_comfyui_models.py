"""The tiny model configs the ComfyUI workers build (tests/_comfyui_cases.py, tests/_comfyui_which_cases.py)."""

TINY_UNET = {  # SD1.5's config (comfy.supported_models.SD15) with tiny widths: 8 heads of 4 and 8 dims
    "model_channels": 32,
    "context_dim": 32,
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

TINY_VAE = {  # SD's AutoencoderKL config (comfy.sd.VAE) with tiny widths; one AttnBlock in each mid block
    "double_z": True,
    "z_channels": 4,
    "resolution": 64,
    "in_channels": 3,
    "out_ch": 3,
    "ch": 32,
    "ch_mult": [1, 2],
    "num_res_blocks": 1,
    "attn_resolutions": [],
    "dropout": 0.0,
}
