"""kvjax: KV-cache optimization as pure, jit-compiled transforms of an explicit cache."""

from kvjax.core.attention import (attend_blockwise, attend_reference, attention_mask,
                                  attention_mass, attention_weights)
from kvjax.backends.dispatch import KernelFallbackWarning, attend, tile_slots
from kvjax.core.layer import CacheLayer, layer_kinds, register_layer
from kvjax.core.cache import (EMPTY, Cache, CacheSpec, ResidualCache, TokenCache, check_cache,
                              free_tokens, init_cache, init_model_cache, nbytes, num_valid,
                              shard_cache, view, write)
from kvjax.policies.codecs import fp8, kivi, quantize
from kvjax.policies.eviction import (Scorer, debug_checks, expected_attention, h2o, knorm,
                                     pyramidkv, random, scored_policy, sliding_window, snapkv,
                                     streaming_llm, tova)
from kvjax.core.layout import compact, pool_heads, resize, shrink
from kvjax.core.selection import keep_top_k
from kvjax.backends.pallas import attend_pallas, supports_pallas
from kvjax.backends.sharded import PallasOnMesh
from kvjax.memory.paging import (NULL_PAGE, PagedLayer, PagePool, PoolError, check_pool,
                                 drop_lowest_pages, evict_pages, fork, init_paged_cache,
                                 page_scores, release, reserve)
from kvjax.policies.methods import METHODS, Method, check_method, parse_method, register_method
from kvjax.policies.feature_maps import (FeatureMap, elu_map, hedgehog, load_maps, random_features,
                                         save_maps)
from kvjax.policies.recurrent import (FoldedLayer, LinearLayer, RecurrentState, fold_evicted,
                                      init_linear_layer, linear_state)
from kvjax.core.stats import LayerStats, StatsSpec, init_stats
from kvjax.core.transforms import CacheTransform, EmptyState, chain, full, on_layers

__all__ = [
    "CacheLayer", "layer_kinds", "register_layer",
    "EMPTY", "Cache", "CacheSpec", "CacheTransform", "LayerStats", "METHODS", "ResidualCache",
    "StatsSpec", "TokenCache", "KernelFallbackWarning", "fp8", "free_tokens", "kivi", "quantize", "view", "attend", "PallasOnMesh", "attend_blockwise", "attend_reference", "attention_mask",
    "attention_mass", "attention_weights", "chain", "check_cache", "compact",
    "expected_attention", "full", "h2o", "init_cache", "init_model_cache", "init_stats",
    "keep_top_k", "knorm", "nbytes", "num_valid", "on_layers", "parse_method", "pool_heads",
    "pyramidkv", "random", "register_method", "resize", "scored_policy", "shard_cache",
    "shrink", "sliding_window", "snapkv", "streaming_llm", "tova", "write",
    "Scorer", "check_method", "debug_checks", "EmptyState", "Method",
    "NULL_PAGE", "PagePool", "PagedLayer", "PoolError", "attend_pallas", "check_pool",
    "drop_lowest_pages", "evict_pages", "fork", "init_paged_cache", "page_scores", "release", "reserve",
    "supports_pallas", "tile_slots",
    "FeatureMap", "FoldedLayer", "LinearLayer", "RecurrentState", "elu_map", "fold_evicted",
    "hedgehog", "init_linear_layer", "linear_state", "load_maps", "random_features", "save_maps",
]
