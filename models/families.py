"""The decoder families kvjax loads from a Hugging Face config.json, as `LlamaConfig`s.

Each family is the Llama decoder (`models.llama`) with a few config fields set;
this module reads those fields from a checkpoint's config.json (transformers
4.x and 5.x spellings) and names each family's tensors that differ from Llama's:

| model_type    | what differs from Llama                                                  |
|---------------|--------------------------------------------------------------------------|
| llama         | (rope scaling "llama3")                                                  |
| mistral       | every layer sliding when `sliding_window` is set                          |
| qwen2         | q/k/v biases; sliding layers per `layer_types` with `use_sliding_window`  |
| qwen3         | per-head q/k RMSNorm, explicit head_dim                                   |
| phi3          | fused qkv and gate/up tensors (split on load), every layer sliding when set |
| gemma3_text   | (1 + w) norms around attention and MLP, GELU-tanh, scaled embeddings,     |
|               | query_pre_attn_scalar, q/k norm, local/global layers with two RoPE bases, |
|               | tied embeddings, logit soft-capping when configured                       |
| gemma3        | the multimodal Gemma 3 (4B-27B): its text decoder, as gemma3_text; the    |
|               | vision tower's tensors are not read                                       |

Example:
    >>> cfg = hf_config({"model_type": "qwen3", "vocab_size": 128, "hidden_size": 64,
    ...                  "intermediate_size": 48, "num_hidden_layers": 2,
    ...                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32})
    >>> cfg.qk_norm, cfg.head_dim, cfg.attention_bias
    (True, 32, False)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from models.llama import LlamaConfig, RopeScaling

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")

_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def longrope_attention_factor(factor: float, original: int) -> float:
    """LongRoPE's default attention factor: sqrt(1 + ln(factor) / ln(original)), 1 when
    factor <= 1 (transformers' and llama.cpp's)."""
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _longrope(params: dict[str, Any], raw: dict[str, Any]) -> RopeScaling:
    """LongRoPE as transformers reads it: `original_max_position_embeddings` from the rope dict
    or the config, `factor` default max / original positions, `attention_factor` default
    sqrt(1 + ln(factor) / ln(original)) (1 when factor <= 1)."""
    original = params.get("original_max_position_embeddings",
                          raw.get("original_max_position_embeddings"))
    if original is None:
        raise ValueError("rope_type='longrope' needs original_max_position_embeddings")
    factor = params.get("factor") or raw.get("max_position_embeddings", original) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = longrope_attention_factor(factor, original)
    return RopeScaling(factor=float(factor), original_max_position=int(original),
                       rope_type="longrope", short_factor=params["short_factor"],
                       long_factor=params["long_factor"], attention_factor=float(attention))


def _rope(params: dict[str, Any], theta_default: float,
          raw: dict[str, Any] | None = None) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from one rope dict (transformers' `rope_scaling` / `rope_parameters`)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", theta_default))
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling(factor=float(params["factor"]), rope_type="linear")
    if rope_type == "llama3":
        return theta, RopeScaling(
            factor=params["factor"], low_freq_factor=params["low_freq_factor"],
            high_freq_factor=params["high_freq_factor"],
            original_max_position=params["original_max_position_embeddings"])
    if rope_type == "longrope":
        return theta, _longrope(params, raw or {})
    raise ValueError(f"unsupported rope scaling rope_type={rope_type!r}; kvjax supports "
                     f"'default', 'llama3', 'linear' and 'longrope'")


def _eos_ids(raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def _layers(raw: dict, model_type: str, num_layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) as transformers builds each family's attention masks."""
    window = raw.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window"):
        window = None  # Qwen's config keeps a window it does not use without the flag
    if model_type == "llama" or not window:
        return None, None
    types = raw.get("layer_types")
    if types is None:  # Mistral, Phi-3: every layer slides (Qwen: from max_window_layers)
        if model_type == "gemma3_text":  # configs before transformers 4.53: a pattern
            pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                     for i in range(num_layers)]
        elif model_type in ("qwen2", "qwen3"):
            first = raw.get("max_window_layers", num_layers)
            types = ["sliding_attention" if i >= first else "full_attention"
                     for i in range(num_layers)]
        else:
            types = ["sliding_attention"] * num_layers
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown:
        raise ValueError(f"config.json layer_types has {unknown}; kvjax reads "
                         f"{sorted(_LAYER_TYPES)}")
    return int(window), tuple(_LAYER_TYPES[t] for t in types)


# transformers' Gemma3TextConfig defaults: a released multimodal config.json (Gemma 3
# 4B/12B/27B) leaves out of its text_config the keys that equal them
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "tie_word_embeddings": True,
}
_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
           "model.multi_modal_projector.")
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))


def text_config(raw: dict) -> dict:
    """The decoder's config.json dict: a multimodal Gemma 3's (model_type 'gemma3',
    Gemma3ForConditionalGeneration) `text_config` with transformers' defaults filled in and
    the top level's token ids; any other config as it is."""
    if raw.get("model_type") != "gemma3":
        return raw
    text = {**GEMMA3_TEXT_DEFAULTS, **(raw.get("text_config") or {}),
            "model_type": "gemma3_text"}
    for key in ("eos_token_id", "bos_token_id"):
        if key in raw:
            text.setdefault(key, raw[key])
    return text


def text_tensor_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name in the text model's scheme ('model.layers...',
    'lm_head.weight'; transformers 4.x and 5.x spellings), None for the vision tower's."""
    if name.startswith(_VISION):
        return None
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def hf_config(raw: dict) -> LlamaConfig:
    """LlamaConfig from a Hugging Face config.json dict; ValueError naming what is unsupported.
    A multimodal Gemma 3 config gives its text decoder's (`text_config`)."""
    raw = text_config(raw)
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r} in config.json; "
                         f"kvjax loads {FAMILIES}")
    gemma = model_type == "gemma3_text"
    act = raw.get("hidden_activation" if gemma else "hidden_act",
                  raw.get("hidden_act", "gelu_pytorch_tanh" if gemma else "silu"))
    if act not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {act!r} in config.json; kvjax supports "
                         f"{sorted(_ACTIVATIONS)}")
    partial = raw.get("partial_rotary_factor", (raw.get("rope_parameters") or {}).get(
        "partial_rotary_factor", 1.0)) if not gemma else 1.0
    if partial != 1.0:
        raise ValueError(f"partial RoPE (partial_rotary_factor={partial}) is not supported; "
                         f"kvjax rotates the whole head (partial_rotary_factor=1.0)")
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    num_layers = raw["num_hidden_layers"]
    window, layer_types = _layers(raw, model_type, num_layers)
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    local_theta = None
    if gemma:
        full = rope.get("full_attention", rope if "rope_type" in rope else {})
        theta, scaling = _rope(full, raw.get("rope_theta", 1_000_000.0))
        local = rope.get("sliding_attention", {})
        local_theta, local_scaling = _rope(local, raw.get("rope_local_base_freq", 10_000.0))
        if local_scaling is not None:
            raise ValueError("Gemma 3 sliding layers with scaled RoPE are not supported")
    else:
        theta, scaling = _rope(rope, raw.get("rope_theta", 10_000.0), raw)
        theta = float(raw.get("rope_theta", theta))
    head_dim = raw.get("head_dim") or hidden // heads
    return LlamaConfig(
        vocab_size=raw["vocab_size"], hidden_size=hidden,
        intermediate_size=raw["intermediate_size"], num_layers=num_layers,
        num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim, rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
        max_position=raw.get("max_position_embeddings", 2048),
        bos_id=raw.get("bos_token_id"), eos_ids=_eos_ids(raw),
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        norm_offset=1.0 if gemma else 0.0, sandwich_norms=gemma,
        activation=_ACTIVATIONS[act], scale_embeddings=gemma,
        query_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5 if gemma else None,
        attn_softcap=raw.get("attn_logit_softcapping") if gemma else None,
        final_softcap=raw.get("final_logit_softcapping") if gemma else None,
        sliding_window=window, layer_types=layer_types, local_rope_theta=local_theta)


def split_fused(raw: dict[str, np.ndarray], cfg: LlamaConfig) -> None:
    """Phi-3's fused tensors, in place: `qkv_proj` -> q/k/v_proj (rows q, then k, then v),
    `gate_up_proj` -> gate/up_proj (rows gate, then up)."""
    q_rows, kv_rows = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name in [n for n in raw if n.endswith((".qkv_proj.weight", ".gate_up_proj.weight"))]:
        w = raw.pop(name)  # [out, in]
        base = name.rsplit(".", 2)[0]
        if name.endswith(".qkv_proj.weight"):
            if w.shape[0] != q_rows + 2 * kv_rows:
                raise ValueError(f"{name} has {w.shape[0]} rows; the config needs "
                                 f"{q_rows} + 2 * {kv_rows}")
            parts = {"q_proj": w[:q_rows], "k_proj": w[q_rows:q_rows + kv_rows],
                     "v_proj": w[q_rows + kv_rows:]}
        else:
            if w.shape[0] != 2 * cfg.intermediate_size:
                raise ValueError(f"{name} has {w.shape[0]} rows; the config needs "
                                 f"2 * intermediate_size = {2 * cfg.intermediate_size}")
            parts = {"gate_proj": w[:cfg.intermediate_size], "up_proj": w[cfg.intermediate_size:]}
        for part, x in parts.items():
            raw[f"{base}.{part}.weight"] = x
