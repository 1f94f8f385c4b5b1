"""Load Llama-family weights into `models.llama.Llama`.

Two formats:
  * a GGUF file (llama.cpp), dequantized with the `gguf` package; the
    Q/K row permutation llama.cpp's converter applies for its RoPE layout is
    undone, so the model uses the Hugging Face rotate-half convention;
  * a Hugging Face checkpoint directory (config.json + *.safetensors) of a
    Llama, Mistral (full attention) or Qwen2 model.

Example:
    >>> model, tokenizer = load_model("smollm2")            # the default model
    >>> model.config.num_layers, tokenizer.decode(tokenizer.encode("Hello world"))
    (30, 'Hello world')

    Any other: `load_model("/path/to/model.gguf", dtype=jnp.bfloat16)`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Iterable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import families
from models.llama import Llama, LlamaConfig

Params = dict[tuple[Any, ...], np.ndarray]
"""Flat weights keyed by the model's state path, e.g. ('layers', 0, 'mlp', 'up_proj', 'kernel')."""

GGUF_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma3")
HF_ARCHS = families.FAMILIES


# ----------------------------------------------------------------------------- building


def build_model(cfg: LlamaConfig, params: Params, dtype: Any = jnp.float32) -> Llama:
    """A `Llama` whose every parameter comes from `params` (cast to `dtype`).

    Raises ValueError naming any missing, unexpected or mis-shaped tensor.
    """
    abstract = nnx.eval_shape(lambda: Llama(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    missing = sorted(set(flat) - set(params), key=str)
    unexpected = sorted(set(params) - set(flat), key=str)
    if missing or unexpected:
        raise ValueError(f"weights do not match the architecture: missing {missing[:5]}"
                         f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{'...' if len(unexpected) > 5 else ''}")
    for path, var in flat.items():
        array = params[path]
        if tuple(array.shape) != tuple(var.shape):
            raise ValueError(f"weight {'.'.join(map(str, path))} has shape {array.shape}, "
                             f"the config needs {var.shape}")
        var.set_value(jnp.asarray(array, dtype=dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _layer_params(i: int, get, transpose,
                  cfg: LlamaConfig | None = None) -> Iterable[tuple[tuple, np.ndarray]]:
    """Yield one decoder layer's weights given `get(name) -> array | None` by our names
    (with `cfg`, the q/k norms and the MLP's norms its family has)."""
    prefix = ("layers", i)
    for ours in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        path = prefix + tuple(ours.split("."))
        yield path + ("kernel",), transpose(get(ours + ".weight"))
        bias = get(ours + ".bias")
        if bias is not None:
            yield path + ("bias",), bias
    norms = ["input_norm", "post_attn_norm"]
    if cfg is not None and cfg.qk_norm:
        norms += ["attn.q_norm", "attn.k_norm"]
    if cfg is not None and cfg.sandwich_norms:
        norms += ["pre_mlp_norm", "post_mlp_norm"]
    for ours in norms:
        yield prefix + tuple(ours.split(".")) + ("weight",), get(ours + ".weight")


# ----------------------------------------------------------------------------- GGUF

# llama.cpp's tensor names (the gguf package's `TENSOR_NAMES`) -> transformers' in a layer;
# Gemma 3 names its four norms apart, and Phi-3's `ffn_up` is the fused gate_up_proj
_GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GGUF_TO_HF_ARCH = {
    "gemma3": {**_GGUF_TO_HF, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {**_GGUF_TO_HF, "ffn_up": "mlp.gate_up_proj"},
}
_GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_GGUF_NOT_WEIGHTS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
GEMMA3_GGUF_LOCAL_ROPE = 10_000.0  # llama.cpp's Gemma 3 sliding layers (not in the file)
GEMMA3_GGUF_PATTERN = 6  # llama.cpp's Gemma 3: every sixth layer global (unless the file says)


def _gguf_value(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _arch_keys(reader, arch: str):
    """(get, need) for a GGUF file's `<arch>.<key>` metadata; `need` raises naming a key the
    file lacks."""
    get = lambda key, default=None: _gguf_value(reader, f"{arch}.{key}", default)

    def need(key: str) -> Any:
        value = get(key)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    return get, need


def gguf_config(reader) -> LlamaConfig:
    """The architecture a GGUF file describes; ValueError for an unsupported one."""
    arch = _gguf_value(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; kvjax loads {GGUF_ARCHS}")
    if arch in ("qwen3", "phi3", "gemma3"):
        return families.hf_config(gguf_hf_config(reader, arch))
    get, need = _arch_keys(reader, arch)

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling {scaling!r}")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"partial RoPE (rope.dimension_count {get('rope.dimension_count')} "
                         f"< head_dim {head_dim}) is not supported")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file lacks tensor 'token_embd.weight'")
    vocab = get("vocab_size") or int(tensors["token_embd.weight"].shape[-1])
    freq_factors = None
    if "rope_freqs.weight" in tensors:
        freq_factors = tuple(float(x) for x in np.asarray(tensors["rope_freqs.weight"].data))
    eos = _gguf_value(reader, "tokenizer.ggml.eos_token_id")
    eot = _gguf_value(reader, "tokenizer.ggml.eot_token_id")
    bos = _gguf_value(reader, "tokenizer.ggml.bos_token_id")
    return LlamaConfig(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")), num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10_000.0)),
        rope_freq_factors=freq_factors,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        max_position=int(get("context_length", 2048)),
        bos_id=None if bos is None else int(bos),
        eos_ids=tuple(int(x) for x in dict.fromkeys((eos, eot)) if x is not None),
    )


def _decimal(x) -> float:
    """A float32 GGUF value as the shortest decimal that rounds to it (1e-06, not
    9.99999997e-07): the number the converter read from config.json."""
    return float(str(np.float32(x)))


def gguf_hf_config(reader, arch: str) -> dict:
    """A transformers config.json dict for a Qwen3, Phi-3 or Gemma 3 GGUF file, from the keys
    llama.cpp's converter writes (`families.hf_config` then reads it as it reads a directory).

    Where the file is silent, llama.cpp's fixed choices for Gemma 3 hold: sliding layers
    use RoPE base 10,000 (`rope.freq_base_swa` when written), every sixth layer is global
    (`attention.sliding_window_pattern`: a period, or one flag per layer, True = sliding),
    and the attention scale is head_dim ** -0.5, (hidden / heads) ** -0.5 for the 27B shape
    (62 layers)."""
    get, need = _arch_keys(reader, arch)

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file lacks tensor 'token_embd.weight'")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    layers = int(need("block_count"))
    eos = [x for x in dict.fromkeys((_gguf_value(reader, "tokenizer.ggml.eos_token_id"),
                                     _gguf_value(reader, "tokenizer.ggml.eot_token_id")))
           if x is not None]
    raw = dict(model_type="gemma3_text" if arch == "gemma3" else arch, hidden_size=hidden,
               intermediate_size=int(need("feed_forward_length")), num_hidden_layers=layers,
               num_attention_heads=heads,
               num_key_value_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
               rms_norm_eps=_decimal(get("attention.layer_norm_rms_epsilon", 1e-6)),
               max_position_embeddings=int(get("context_length", 2048)),
               rope_theta=_decimal(get("rope.freq_base", 10_000.0)),
               vocab_size=int(tensors["token_embd.weight"].shape[-1]),
               tie_word_embeddings="output.weight" not in tensors,
               bos_token_id=_gguf_value(reader, "tokenizer.ggml.bos_token_id"),
               eos_token_id=[int(x) for x in eos])
    dims = int(get("rope.dimension_count", head_dim))
    if dims != head_dim:
        raw["partial_rotary_factor"] = dims / head_dim  # refused by name (hf_config)
    scaling = get("rope.scaling.type")
    if arch == "gemma3":
        pattern = get("attention.sliding_window_pattern", GEMMA3_GGUF_PATTERN)
        if isinstance(pattern, (list, tuple)):  # one flag per layer
            raw["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
        else:
            raw["sliding_window_pattern"] = int(pattern)
        raw.update(sliding_window=int(need("attention.sliding_window")),
                   rope_local_base_freq=_decimal(get("rope.freq_base_swa",
                                                     GEMMA3_GGUF_LOCAL_ROPE)),
                   query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
                   final_logit_softcapping=None if get("final_logit_softcapping") is None
                   else _decimal(get("final_logit_softcapping")))
        if scaling == "linear":
            raw["rope_scaling"] = {"rope_type": "linear",
                                   "factor": _decimal(need("rope.scaling.factor"))}
    elif arch == "phi3":
        raw["sliding_window"] = int(get("attention.sliding_window", 0)) or None
        original = get("rope.scaling.original_context_length")
        if original is not None:
            raw["original_max_position_embeddings"] = int(original)
        if "rope_factors_long.weight" in tensors:
            factors = lambda name: [_decimal(x) for x in np.asarray(tensors[name].data)]
            raw["rope_scaling"] = {
                "rope_type": "longrope", "long_factor": factors("rope_factors_long.weight"),
                "short_factor": factors("rope_factors_short.weight")}
            stored = np.float32(get("rope.scaling.attn_factor", 1.0))
            if stored != np.float32(families.longrope_attention_factor(
                    int(get("context_length", 2048)) / int(original or 1), int(original or 1))):
                raw["rope_scaling"]["attention_factor"] = _decimal(stored)  # else transformers'
                # default, computed as a directory's config gets it (not its float32 rounding)
    if scaling not in (None, "none") and "rope_scaling" not in raw:
        raise ValueError(f"unsupported GGUF rope scaling {scaling!r} for {arch}")
    return raw


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation ([out, ...] rows, interleaved -> halves)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` for `path`, with clear errors for a missing or bad file."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises assorted errors on garbage
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None


PROGRESS_ENV = "KVJAX_PROGRESS"


def progress_enabled(progress: bool | None = None) -> bool:
    """Whether to draw a progress bar (on stderr, never stdout): `progress` when given, else
    $KVJAX_PROGRESS (1 forces bars, 0 hides them), else whether stderr is a terminal.

    Example:
        >>> progress_enabled(False), progress_enabled(True)
        (False, True)
    """
    if progress is not None:
        return bool(progress)
    forced = os.environ.get(PROGRESS_ENV, "")
    if forced:
        return forced not in ("0", "false", "no")
    return sys.stderr.isatty()


def load_gguf(path_or_reader, progress: bool = False) -> tuple[LlamaConfig, Params]:
    """Read and dequantize a GGUF file: (config, float32 weights by state path); with
    `progress`, a bar over the tensors on stderr. The tensors are renamed to transformers'
    names (llama.cpp's Llama Q/K row permutation and Gemma's stored 1 + w norms undone) and
    read as a Hugging Face directory's are (`params_from_hf_tensors`)."""
    import gguf
    from tqdm import tqdm

    reader = path_or_reader if isinstance(path_or_reader, gguf.GGUFReader) else open_gguf(path_or_reader)
    cfg = gguf_config(reader)
    arch = _gguf_value(reader, "general.architecture")
    tensors = {t.name: t for t in reader.tensors}

    def tensor(name: str) -> np.ndarray:
        t = tensors[name]
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)

    names = _GGUF_TO_HF_ARCH.get(arch, _GGUF_TO_HF)
    raw: dict[str, np.ndarray] = {}
    for name in tqdm(tensors, desc="dequantizing GGUF tensors", unit="tensor",
                     disable=not progress, file=sys.stderr):
        if name in _GGUF_NOT_WEIGHTS:
            continue
        parts = name.split(".")  # blk.<i>.<gguf name>.<weight|bias>
        if name in _GGUF_GLOBAL:
            hf = _GGUF_GLOBAL[name]
        elif parts[0] == "blk" and len(parts) == 4 and parts[2] in names:
            hf = f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
        else:
            raise ValueError(f"GGUF tensor {name!r} is not one kvjax reads for {arch}")
        x = tensor(name)
        if arch == "llama" and parts[2:3] in (["attn_q"], ["attn_k"]):
            x = unpermute_rope_rows(x, cfg.num_heads if parts[2] == "attn_q" else cfg.num_kv_heads)
        if arch == "gemma3" and hf.endswith("norm.weight"):
            x = x - 1.0  # llama.cpp stores Gemma's (1 + w) norms as 1 + w
        raw[hf] = x
    hf_to_gguf = {hf: gguf_name for gguf_name, hf in names.items()}
    global_names = {hf: gguf_name for gguf_name, hf in _GGUF_GLOBAL.items()}

    def source_name(hf: str) -> str:  # for errors: the name the GGUF file would use
        if hf in global_names:
            return global_names[hf]
        _, _, i, *base, kind = hf.split(".")  # model.layers.<i>.<module path>.<kind>
        return f"blk.{i}.{hf_to_gguf.get('.'.join(base), '.'.join(base))}.{kind}"

    return cfg, params_from_hf_tensors(raw, cfg, f"GGUF file {getattr(reader, 'path', '')}",
                                       source_name)


# ----------------------------------------------------------------------------- HF directory

_HF_LAYER_NAMES = {
    "attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj", "attn.o_proj": "self_attn.o_proj",
    "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.up_proj",
    "mlp.down_proj": "mlp.down_proj", "input_norm": "input_layernorm",
    "post_attn_norm": "post_attention_layernorm", "attn.q_norm": "self_attn.q_norm",
    "attn.k_norm": "self_attn.k_norm", "pre_mlp_norm": "pre_feedforward_layernorm",
    "post_mlp_norm": "post_feedforward_layernorm",
}


def hf_config(raw: dict) -> LlamaConfig:
    """LlamaConfig from a Hugging Face config.json dict; ValueError if unsupported
    (`models.families.hf_config`)."""
    return families.hf_config(raw)


def read_hf_config(file: Path) -> LlamaConfig:
    """`hf_config` of a config.json file; ValueError naming the file for a file that is not
    JSON, not an object, or lacks a key or value the architecture needs."""
    try:
        raw = json.loads(Path(file).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{file}: not a valid JSON config ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: a config is a JSON object, got {type(raw).__name__}")
    try:
        return hf_config(raw)
    except KeyError as e:
        raise ValueError(f"{file}: key {e} is missing") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{file}: {e}") from None


def load_hf_dir(path: str | os.PathLike,
                dtype: Any = jnp.float32) -> tuple[LlamaConfig, Params]:
    """Read a Hugging Face checkpoint directory: (config, weights by state path), each tensor
    cast to `dtype` as it is read (float32 by default; `jnp.bfloat16` keeps a bf16
    checkpoint's tensors as they are, with no float32 copy of the model on the host)."""
    from safetensors import safe_open

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
    index = path / "model.safetensors.index.json"
    if index.is_file():  # sharded: read exactly the files the index names
        try:
            names = json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()
            files = sorted({path / f for f in names})
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index with a weight_map "
                             f"({type(e).__name__}: {e})") from None
        if any(".." in Path(f).parts or Path(f).is_absolute() for f in names):
            raise ValueError(f"{index}: names a file outside {path}")
    else:  # Mistral repos also ship consolidated.safetensors in another naming scheme
        files = sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("consolidated"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    cfg = read_hf_config(path / "config.json")
    raw: dict[str, np.ndarray] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="flax") as sf:
                for name in sf.keys():
                    ours = families.text_tensor_name(name)  # a multimodal Gemma 3's text model
                    if ours is not None:  # (None: its vision tower, not read)
                        raw[ours] = np.asarray(sf.get_tensor(name).astype(dtype))
        except FileNotFoundError:
            raise FileNotFoundError(f"{f}: missing (named by {path})") from None
        except Exception as e:  # safetensors' own errors on a damaged file
            raise ValueError(f"{f}: not a readable safetensors file ({type(e).__name__}: "
                             f"{str(e)[:200]})") from None

    return cfg, params_from_hf_tensors(raw, cfg, str(path))


def params_from_hf_tensors(raw: dict[str, np.ndarray], cfg: LlamaConfig, where: str,
                          source_name=lambda name: name) -> Params:
    """Weights by state path from tensors by transformers' names (consumed from `raw`); a
    ValueError naming `where` and the tensor (`source_name` of its transformers name) for a
    missing tensor or one no weight of `cfg` takes."""
    def required(name: str) -> np.ndarray:
        if name not in raw:
            raise ValueError(f"{where}: tensor {source_name(name)!r} is missing")
        return raw.pop(name)

    families.split_fused(raw, cfg)  # Phi-3's qkv_proj and gate_up_proj
    params: Params = {("embed",): required("model.embed_tokens.weight"),
                      ("norm", "weight"): required("model.norm.weight")}
    if not cfg.tie_embeddings:
        params[("lm_head", "kernel")] = required("lm_head.weight").T
    raw.pop("lm_head.weight", None)  # a tied checkpoint may store the copy
    for i in range(cfg.num_layers):
        def get(ours: str, i=i) -> np.ndarray | None:
            base, _, kind = ours.rpartition(".")
            name = f"model.layers.{i}.{_HF_LAYER_NAMES[base]}.{kind}"
            return raw.pop(name, None) if kind == "bias" else required(name)
        params.update(_layer_params(i, get, transpose=lambda w: w.T, cfg=cfg))
    leftover = [source_name(k) for k in raw if "rotary_emb" not in k]
    if leftover:
        raise ValueError(f"{where}: unexpected tensors {leftover[:5]}")
    return params


# ----------------------------------------------------------------------------- entry point


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """`smollm2` -> the default GGUF (found or fetched); an existing path as it is; a Hugging
    Face repo id ('org/name' or 'org/name@revision') -> its snapshot in the hub cache."""
    from models.hub import find_smollm2, from_hugging_face, is_repo_id

    if str(name_or_path) == "smollm2":
        return find_smollm2()
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    if is_repo_id(str(name_or_path)):
        return from_hugging_face(str(name_or_path))
    raise FileNotFoundError(f"model {str(name_or_path)!r} not found: pass 'smollm2', a .gguf "
                            f"file, a Hugging Face model directory or repo id (org/name)")


def load_weights(name_or_path: str | os.PathLike) -> tuple[LlamaConfig, Params]:
    """(config, float32 weights) from 'smollm2', a .gguf file or an HF directory."""
    path = resolve_model_path(name_or_path)
    return load_hf_dir(path) if path.is_dir() else load_gguf(path)


def load_model(name_or_path: str | os.PathLike = "smollm2", dtype: Any = jnp.float32, *,
               use_converted: bool = True, progress: bool | None = None):
    """(Llama, Tokenizer) from 'smollm2', a .gguf file or an HF directory.

    A GGUF file is parsed and dequantized once (about 20 s for SmolLM2 on two
    cores); the float32 result is kept under the kvjax cache directory,
    keyed by the file's path, size and modification time, and later loads
    read that instead (about 1 s). `use_converted=False` skips the store.
    That first conversion draws a progress bar on stderr (`progress_enabled`:
    a terminal, $KVJAX_PROGRESS=1 or `progress=True`).

    Loading switches on jax's persistent compilation cache in the kvjax cache directory, so
    a second session skips XLA compilation (`models.hub.enable_compilation_cache`; opt out
    with `KVJAX_COMPILATION_CACHE=0`; a `jax_compilation_cache_dir` you set is kept).
    """
    from models.hub import enable_compilation_cache
    from models.tokenizer import Tokenizer, load_tokenizer

    try:
        floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise ValueError(f"dtype must be a floating-point type such as jnp.float32 or "
                         f"jnp.bfloat16, got {dtype!r}")
    path = resolve_model_path(name_or_path)
    enable_compilation_cache()
    if path.is_dir():
        cfg, params = load_hf_dir(path, dtype)  # read as `dtype`: no float32 copy for bf16
        tokenizer = load_tokenizer(path)
        check_vocab(cfg, tokenizer, path)
        return build_model(cfg, params, dtype), tokenizer
    converted = converted_dir(path)
    if use_converted and converted.is_dir():
        stored = _load_converted_checked(converted, path)
        if stored is not None:
            cfg, params, tokenizer = stored
            check_vocab(cfg, tokenizer, path)
            return build_model(cfg, params, dtype), tokenizer
    show = progress_enabled(progress)
    if show:
        print(f"kvjax: converting {path.name} to float32 (once; later loads read the copy)",
              file=sys.stderr, flush=True)
    reader = open_gguf(path)  # parsed once for weights and tokenizer
    (cfg, params), tokenizer = load_gguf(reader, progress=show), Tokenizer.from_gguf(reader)
    check_vocab(cfg, tokenizer, path)
    if use_converted:
        save_converted(converted, cfg, params, tokenizer)
    return build_model(cfg, params, dtype), tokenizer


def model_config(name_or_path: str | os.PathLike = "smollm2") -> LlamaConfig:
    """The model's architecture without loading its weights (config.json, the converted
    store's config or the GGUF metadata)."""
    path = resolve_model_path(name_or_path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model "
                                    f"directory")
        return read_hf_config(path / "config.json")
    try:  # the converted store's copy: 3 s faster than parsing the GGUF
        return _converted_config(converted_dir(path))
    except (OSError, ValueError, TypeError, KeyError):
        return gguf_config(open_gguf(path))


def check_vocab(cfg: LlamaConfig, tokenizer, source) -> None:
    """ValueError when the tokenizer can produce ids the model has no embedding row for."""
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"{source}: the tokenizer has {tokenizer.vocab_size} token ids but the "
                         f"model's vocabulary (vocab_size) is {cfg.vocab_size}; ids >= "
                         f"{cfg.vocab_size} would read no embedding")


# ----------------------------------------------------------------------------- converted store

CONVERTED_FORMAT = 1  # bump when the stored layout changes


def converted_dir(gguf_path: Path) -> Path:
    """Where the dequantized copy of `gguf_path` lives (changes when the file does)."""
    from models.hub import cache_dir

    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CONVERTED_FORMAT}"
    return cache_dir() / "converted" / hashlib.sha1(key.encode()).hexdigest()[:16]


MANIFEST = "manifest.json"


def _file_crc(path: Path) -> str:
    """CRC-32 of a file (0.5 s for SmolLM2's 538 MB of weights, page-cached)."""
    import zlib

    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def write_manifest(folder: Path) -> None:
    """Record the size and CRC-32 of every file of a converted store."""
    files = sorted(f for f in folder.iterdir() if f.is_file() and f.name != MANIFEST)
    manifest = {f.name: {"size": f.stat().st_size, "crc32": _file_crc(f)} for f in files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))


def store_damage(folder: Path) -> str | None:
    """Why a converted store is unusable (a missing, resized or changed file), or None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return "its manifest is missing or unreadable"
    for name in ("config.json", "weights.safetensors"):
        if name not in manifest:
            return f"its manifest lacks {name}"
    for name, want in manifest.items():
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want.get("size"):
            return f"{name} has {f.stat().st_size} bytes, the manifest says {want.get('size')}"
        if _file_crc(f) != want.get("crc32"):
            return f"{name} does not match its checksum"
    return None


def _load_converted_checked(folder: Path, gguf_path: Path):
    """(cfg, params, tokenizer) from a converted store, or None after removing a damaged one.

    A store from before manifests is checked by loading it, then given a manifest.
    """
    from models.tokenizer import load_tokenizer

    legacy = not (folder / MANIFEST).exists() and (folder / "config.json").is_file()
    damage = None if legacy else store_damage(folder)
    if damage is None:
        try:
            cfg, params = load_converted(folder)
            tokenizer = load_tokenizer(folder)
        except Exception as e:  # safetensors, JSON and tokenizer errors of a damaged file
            damage = f"it does not load ({type(e).__name__}: {str(e)[:120]})"
        else:
            if legacy:
                try:
                    write_manifest(folder)
                except OSError:
                    pass
            return cfg, params, tokenizer
    print(f"kvjax: the converted copy of {gguf_path.name} in {folder} is damaged ({damage}); "
          f"converting the GGUF again", file=sys.stderr)
    trash = folder.with_name(f"{folder.name}.damaged-{os.getpid()}")
    try:
        folder.rename(trash)  # atomic: a concurrent reader sees the store or nothing
    except OSError:
        trash = folder
    shutil.rmtree(trash, ignore_errors=True)
    return None


def save_converted(target: Path, cfg: LlamaConfig, params: Params, tokenizer) -> None:
    """Store config, float32 weights, tokenizer and a manifest (size and CRC-32 of each
    file); best effort (a full disk only warns)."""
    from safetensors.numpy import save_file

    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    try:
        partial.mkdir(parents=True)
        tokenizer.save(partial)
        save_file({"/".join(map(str, k)): np.ascontiguousarray(v) for k, v in params.items()},
                  str(partial / "weights.safetensors"))
        (partial / "config.json").write_text(json.dumps(cfg.to_dict()))
        write_manifest(partial)
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        print(f"kvjax: could not keep the converted model ({e}); the next load converts again",
              file=sys.stderr)
        return
    try:
        partial.rename(target)  # atomic; fails if a concurrent process got there first
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)


def load_converted(source: Path) -> tuple[LlamaConfig, Params]:
    """Read what `save_converted` wrote."""
    from safetensors.numpy import load_file

    key = lambda name: tuple(int(p) if p.isdigit() else p for p in name.split("/"))
    return _converted_config(source), {key(k): v for k, v in load_file(str(source / "weights.safetensors")).items()}


def _converted_config(source: Path) -> LlamaConfig:
    return LlamaConfig.from_dict(json.loads((source / "config.json").read_text()))
