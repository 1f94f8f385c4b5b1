"""Flax NNX decoders, weight loaders, tokenizer and sampler.

Importing `models` changes no global setting. `models.loading.load_model` (the notebook entry
point) and the `kvjax` command switch on jax's persistent compilation cache in the kvjax cache
directory (`models.hub.enable_compilation_cache`; opt out with `KVJAX_COMPILATION_CACHE=0`; a
`jax_compilation_cache_dir` you set yourself is left alone).
"""
