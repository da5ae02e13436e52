"""The attention APIs people already call, over subquad's core: one import away, on every device.

- ``subquad.compat.flash_attn``: flash-attn's functions (``flash_attn_func``, the varlen and
  packed variants, ``flash_attn_with_kvcache``, ``bert_padding``); ``install()`` makes ``import
  flash_attn`` resolve to it where the real package cannot be imported.
- ``subquad.compat.xformers``: ``xformers.ops.memory_efficient_attention`` and its
  ``fmha.attn_bias`` classes; ``install()`` for machines where xformers has no operator.
- ``subquad.compat.sub_quadratic``: Birch-san's ``efficient_dot_product_attention`` (AUTOMATIC1111,
  ComfyUI).
- ``subquad.compat.memory_efficient_attention``: the seed package's
  ``efficient_dot_product_attention_pt`` / ``_jax``, exact where its chunking was not.

Each is imported on its own (``import subquad.compat.flash_attn``); none imports the library it
stands in for unless asked to recognize its objects.
"""

__all__ = ["flash_attn", "xformers", "sub_quadratic", "memory_efficient_attention"]
