"""kvjax: KV-cache optimization as pure, jit-compiled transforms of an explicit cache."""

from kvjax.attention import (attend_blockwise, attend_reference, attention_mask,
                             attention_mass, attention_weights)
from kvjax.dispatch import attend
from kvjax.cache import (EMPTY, Cache, CacheSpec, ResidualCache, TokenCache, check_cache,
                         free_tokens, init_cache, init_model_cache, nbytes, num_valid,
                         shard_cache, view, write)
from kvjax.codecs import fp8, kivi, quantize
from kvjax.eviction import (Scorer, debug_checks, expected_attention, h2o, knorm, pyramidkv,
                            random, scored_policy, sliding_window, snapkv, streaming_llm, tova)
from kvjax.layout import compact, pool_heads, resize, shrink
from kvjax.selection import keep_top_k
from kvjax.kernel_attention import attend_pallas, supports_pallas
from kvjax.sharded_attention import PallasOnMesh
from kvjax.paging import (NULL_PAGE, PagedLayer, PagePool, PoolError, check_pool,
                          drop_lowest_pages, evict_pages, fork, init_paged_cache, page_scores,
                          release, reserve)
from kvjax.methods import METHODS, check_method, parse_method, register_method
from kvjax.feature_maps import FeatureMap, elu_map, hedgehog, load_maps, random_features, save_maps
from kvjax.recurrent import (FoldedLayer, LinearLayer, RecurrentState, fold_evicted,
                             init_linear_layer, linear_state)
from kvjax.stats import LayerStats, StatsSpec, init_stats
from kvjax.transforms import CacheTransform, chain, full, on_layers

__all__ = [
    "EMPTY", "Cache", "CacheSpec", "CacheTransform", "LayerStats", "METHODS", "ResidualCache",
    "StatsSpec", "TokenCache", "fp8", "free_tokens", "kivi", "quantize", "view", "attend", "PallasOnMesh", "attend_blockwise", "attend_reference", "attention_mask",
    "attention_mass", "attention_weights", "chain", "check_cache", "compact",
    "expected_attention", "full", "h2o", "init_cache", "init_model_cache", "init_stats",
    "keep_top_k", "knorm", "nbytes", "num_valid", "on_layers", "parse_method", "pool_heads",
    "pyramidkv", "random", "register_method", "resize", "scored_policy", "shard_cache",
    "shrink", "sliding_window", "snapkv", "streaming_llm", "tova", "write",
    "Scorer", "check_method", "debug_checks",
    "NULL_PAGE", "PagePool", "PagedLayer", "PoolError", "attend_pallas", "check_pool",
    "drop_lowest_pages", "evict_pages", "fork", "init_paged_cache", "page_scores", "release", "reserve",
    "supports_pallas",
    "FeatureMap", "FoldedLayer", "LinearLayer", "RecurrentState", "elu_map", "fold_evicted",
    "hedgehog", "init_linear_layer", "linear_state", "load_maps", "random_features", "save_maps",
]
