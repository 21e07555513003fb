"""hopperlm: train decoder-only language models fast on Hopper GPUs, with honest fallbacks down to CPU."""

__version__ = "0.1.0"
