"""Flax NNX decoders, weight loaders, tokenizer and sampler."""
