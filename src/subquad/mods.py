"""Built-in ``score_mod`` / ``mask_mod`` callbacks (FlexAttention's conventions)."""
