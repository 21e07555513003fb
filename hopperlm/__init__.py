"""hopperlm: train decoder-only language models fast on Hopper GPUs, with honest fallbacks down to CPU.

Layers, each importing only from those below (tests/test_layers.py): errors, provenance < config/ < hardware,
selftest < model/ < data/ < checkpoint/ < plan, memory, speed/, parallel/ < train/, observe/, eval/, bench < cli/.
"""

__version__ = "0.1.0"
