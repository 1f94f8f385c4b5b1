"""kvjax: KV-cache optimization as pure, jit-compiled transforms of an explicit cache."""

from kvjax.attention import attend, attend_blockwise, attend_reference, attention_mask
from kvjax.cache import (EMPTY, Cache, CacheSpec, TokenCache, check_cache, init_cache,
                         init_model_cache, nbytes, num_valid, shard_cache, write)
from kvjax.eviction import compact, keep_top_k, sliding_window, streaming_llm
from kvjax.methods import METHODS, parse_method, register_method
from kvjax.transforms import CacheTransform, chain, full

__all__ = [
    "EMPTY", "Cache", "CacheSpec", "CacheTransform", "METHODS", "TokenCache",
    "attend", "attend_blockwise", "attend_reference", "compact", "keep_top_k",
    "sliding_window", "streaming_llm", "attention_mask", "chain", "check_cache", "full",
    "init_cache", "init_model_cache", "nbytes", "num_valid", "parse_method",
    "register_method", "shard_cache", "write",
]
