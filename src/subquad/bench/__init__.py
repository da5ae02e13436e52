"""``subquad bench``: time, TFLOP/s, peak memory and accuracy of attention implementations
(SDPA's backends, xformers, flash-attn, naive attention, subquad) on named presets or given
shapes, timed in interleaved rounds (``timing``); with ``--model``, whole models (SD 1.5's UNet,
SD's VAE decoder, Llama) with each attention implementation (``models``, ``model_measure``).
Run ``subquad bench --help`` or ``python -m subquad.bench --help``; docs/bench.md describes each
metric and how it is measured.

Needs only torch; ``pip install 'subquad[bench]'`` adds rich (tables, progress) and matplotlib
(plots), both imported only when used.
"""

from .cli import main

__all__ = ["main"]
