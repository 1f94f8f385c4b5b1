"""Flax NNX decoders, weight loaders, tokenizer and sampler.

Importing `models` switches on jax's persistent compilation cache in the kvjax cache directory
(`models.hub.enable_compilation_cache`; opt out with `KVJAX_COMPILATION_CACHE=0`).
"""

from models.hub import enable_compilation_cache

enable_compilation_cache()
