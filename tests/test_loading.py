"""Tests for models.loading: the Hugging Face and GGUF loaders and their errors.

Reference: ``tests/golden/tiny_hf/<name>/`` holds tiny random checkpoints
written by ``transformers`` itself and its float32 logits for fixed inputs
(made by ``experiments/golden/make_tiny_hf.py``): ``llama_tied`` (default
RoPE), ``llama3_untied`` (Llama-3 RoPE scaling, separate lm_head) and
``qwen2_tied`` (q/k/v biases). The HF loader is checked against those logits;
GGUF files are rebuilt here from the same weights the way llama.cpp's
converter writes them (its tensor names, its Q/K row permutation for the
"llama" arch, ``rope_freqs`` for Llama-3 scaling, a byte-level BPE
vocabulary) and must load to the same model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import models.loading
from models.llama import new_cache
from models.loading import (build_model, gguf_config, load_gguf, load_hf_dir, load_model,
                            load_weights, open_gguf, resolve_model_path)

GOLDEN = Path(__file__).parent / "golden" / "tiny_hf"
NAMES = ["llama_tied", "llama3_untied", "qwen2_tied"]

Q8_0 = gguf.GGMLQuantizationType.Q8_0


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def private_kvjax_cache(tmp_path, monkeypatch):
    """Converted copies of the throwaway GGUFs go to a temporary cache, not ~/.cache/kvjax."""
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "kvjax-cache"))


def forward(model, ids, positions=None) -> np.ndarray:
    """Logits [B, T, V] of one pass over `ids` in a fresh cache."""
    ids = np.asarray(ids)
    b, t = ids.shape
    if positions is None:
        positions = np.broadcast_to(np.arange(t), (b, t))
    logits, _ = model(jnp.asarray(ids, jnp.int32), jnp.asarray(positions, jnp.int32),
                      new_cache(model.config, b, t))
    return np.asarray(logits)


def golden(name: str) -> dict[str, np.ndarray]:
    with np.load(GOLDEN / name / "logits.npz") as f:
        return {k: f[k] for k in f.files}


def golden_forward(model, name: str) -> np.ndarray:
    g = golden(name)
    return forward(model, g["input_ids"], g["position_ids"])


@pytest.fixture(scope="module")
def hf_logits():
    """name -> logits of the HF-directory model on its golden inputs (computed once)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = golden_forward(build_model(*load_hf_dir(GOLDEN / name)), name)
        return cache[name]
    return get


def copy_hf_dir(name: str, dst: Path) -> Path:
    shutil.copytree(GOLDEN / name, dst)
    return dst


# A byte-level BPE vocabulary of exactly 128 tokens: 3 control tokens, the 95
# printable ASCII bytes (space is 'Ġ' in the byte-to-unicode map) and 30 merges.
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTES = [chr(b) for b in range(33, 127)] + ["\u0120"]
MERGES = [("\u0120", "t"), ("\u0120", "a"), ("t", "h"), ("h", "e"), ("i", "n"), ("e", "r"),
          ("a", "n"), ("r", "e"), ("o", "n"), ("a", "t"), ("e", "n"), ("n", "d"), ("t", "i"),
          ("e", "s"), ("o", "r"), ("t", "e"), ("o", "f"), ("e", "d"), ("i", "s"), ("i", "t"),
          ("a", "l"), ("a", "r"), ("s", "t"), ("t", "o"), ("n", "t"), ("n", "g"), ("s", "e"),
          ("h", "a"), ("a", "s"), ("o", "u")]
TOKENS = CONTROL + BYTES + [a + b for a, b in MERGES]
assert len(TOKENS) == len(set(TOKENS)) == 128


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (Q/K rows, weights and biases)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(raw: dict) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp's converter writes for rope_type llama3."""
    rope = raw["rope_parameters"]
    dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    old_ctx = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / rope["low_freq_factor"], old_ctx / rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (old_ctx / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.asarray(factors, np.float32)


HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_gguf(path: Path, name: str, *, quant: str = "f32", permute: bool = True,
               arch: str | None = None, drop: tuple[str, ...] = ()) -> Path:
    """A GGUF file of the golden HF checkpoint `name`, written as llama.cpp would.

    quant: "f32"; or "q8_0" (2-D tensors whose rows are a multiple of 32 in
    Q8_0, the others in F16, 1-D ones in F32, like llama.cpp's fallback).
    permute: apply llama.cpp's Q/K row permutation (arch "llama" only).
    drop: tensor names to leave out.
    """
    raw = json.loads((GOLDEN / name / "config.json").read_text())
    hf = load_file(str(GOLDEN / name / "model.safetensors"))
    arch = arch or raw["model_type"]
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]

    tensors: dict[str, np.ndarray] = {"token_embd.weight": hf["model.embed_tokens.weight"],
                                      "output_norm.weight": hf["model.norm.weight"]}
    if not raw["tie_word_embeddings"]:
        tensors["output.weight"] = hf["lm_head.weight"]
    if raw["rope_parameters"].get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_factors(raw)
    for i in range(raw["num_hidden_layers"]):
        for hf_name, gguf_name in HF_TO_GGUF.items():
            for kind in ("weight", "bias"):
                w = hf.get(f"model.layers.{i}.{hf_name}.{kind}")
                if w is None:
                    continue
                if permute and arch == "llama" and gguf_name in ("attn_q", "attn_k"):
                    w = llama_permute(w, heads if gguf_name == "attn_q" else kv_heads)
                tensors[f"blk.{i}.{gguf_name}.{kind}"] = w

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {name}")
    writer.add_context_length(raw["max_position_embeddings"])
    writer.add_embedding_length(raw["hidden_size"])
    writer.add_block_count(raw["num_hidden_layers"])
    writer.add_feed_forward_length(raw["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(raw["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    writer.add_vocab_size(raw["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quant == "q8_0" else gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    if arch == "llama":  # the qwen2 file has no `pre`: the tokenizer defaults to "default"
        writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(CONTROL) + [1] * (len(TOKENS) - len(CONTROL)))
    writer.add_token_merges([f"{a} {b}" for a, b in MERGES])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for tname, w in tensors.items():
        if tname in drop:
            continue
        w = np.ascontiguousarray(w, np.float32)
        if quant == "q8_0" and w.ndim == 2:
            if w.shape[-1] % 32 == 0:
                writer.add_tensor(tname, gguf.quants.quantize(w, Q8_0), raw_dtype=Q8_0)
            else:
                writer.add_tensor(tname, w.astype(np.float16))
        else:
            writer.add_tensor(tname, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """(name, quant) -> path of a GGUF rebuilt from that golden checkpoint (written once)."""
    folder = tmp_path_factory.mktemp("gguf")
    cache = {}

    def get(name, quant="f32"):
        if (name, quant) not in cache:
            cache[name, quant] = write_gguf(folder / f"{name}.{quant}.gguf", name, quant=quant)
        return cache[name, quant]
    return get


# ----------------------------------------------------------------------------- Hugging Face


def test_golden_files_are_what_the_tests_expect():
    for name in NAMES:
        g = golden(name)
        assert g["input_ids"].shape == (2, 10) and g["logits"].shape == (2, 10, 128)
        assert str(g["transformers_version"]).count(".") >= 1
        assert g["logits"].std() > 0.5  # O(1) logits: 1e-4 is a tight tolerance


@pytest.mark.parametrize("name", NAMES)
def test_hf_dir_matches_transformers_logits(name, hf_logits):
    cfg, params = load_hf_dir(GOLDEN / name)
    raw = json.loads((GOLDEN / name / "config.json").read_text())
    assert cfg.tie_embeddings == raw["tie_word_embeddings"]
    assert cfg.attention_bias == (name == "qwen2_tied")
    assert (cfg.rope_scaling is not None) == (name == "llama3_untied")
    assert cfg.rope_theta == raw["rope_parameters"]["rope_theta"]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 16, 128)
    assert all(v.dtype == np.float32 for v in params.values())
    want = golden(name)["logits"]
    np.testing.assert_allclose(hf_logits(name), want, rtol=0, atol=1e-4)


def test_llama3_rope_scaling_matters_in_the_golden():
    """Loading llama3_untied without its RoPE scaling must miss the reference by far."""
    cfg, params = load_hf_dir(GOLDEN / "llama3_untied")
    model = build_model(dataclasses.replace(cfg, rope_scaling=None), params)
    assert np.abs(golden_forward(model, "llama3_untied") - golden("llama3_untied")["logits"]).max() > 1e-2


def test_qwen2_biases_matter_in_the_golden():
    cfg, params = load_hf_dir(GOLDEN / "qwen2_tied")
    params = {k: (np.zeros_like(v) if k[-1] == "bias" else v) for k, v in params.items()}
    model = build_model(cfg, params)
    assert np.abs(golden_forward(model, "qwen2_tied") - golden("qwen2_tied")["logits"]).max() > 1e-2


def test_load_model_and_load_weights_on_an_hf_dir():
    """A directory goes through the HF loader (no tokenizer.json here: load_model needs one)."""
    cfg, params = load_weights(GOLDEN / "llama_tied")
    assert cfg.tie_embeddings and ("lm_head", "kernel") not in params
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_model(GOLDEN / "llama_tied")


def test_hf_dir_with_bfloat16_safetensors(tmp_path):
    """bf16 checkpoints (the usual HF dtype) load as float32 copies of the bf16 values."""
    d = copy_hf_dir("llama_tied", tmp_path / "bf16")
    tensors = load_file(str(d / "model.safetensors"))
    from safetensors.flax import save_file as save_flax
    save_flax({k: jnp.asarray(v, jnp.bfloat16) for k, v in tensors.items()},
              str(d / "model.safetensors"))
    _, params = load_hf_dir(d)
    _, ref = load_hf_dir(GOLDEN / "llama_tied")
    for k, v in params.items():
        assert v.dtype == np.float32
        np.testing.assert_array_equal(v, np.asarray(jnp.asarray(ref[k], jnp.bfloat16), np.float32))


# ----------------------------------------------------------------------------- GGUF


@pytest.mark.parametrize("name", NAMES)
def test_gguf_f32_round_trip_equals_hf_dir(name, gguf_files, hf_logits):
    cfg, params = load_gguf(gguf_files(name))
    hf_cfg, hf_params = load_hf_dir(GOLDEN / name)
    # the same architecture (Llama-3 scaling arrives as rope_freqs factors in a GGUF)
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "rope_theta", "tie_embeddings", "attention_bias",
              "max_position", "bos_id", "eos_ids")
    assert {f: getattr(cfg, f) for f in fields} == {f: getattr(hf_cfg, f) for f in fields}
    assert cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps, rel=1e-6)
    assert (cfg.rope_freq_factors is not None) == (hf_cfg.rope_scaling is not None)
    # the same weights, bit for bit (the Q/K permutation undone)
    assert sorted(params, key=str) == sorted(hf_params, key=str)
    for k in params:
        np.testing.assert_array_equal(params[k], hf_params[k], err_msg=str(k))
    got = golden_forward(build_model(cfg, params), name)
    np.testing.assert_allclose(got, hf_logits(name), rtol=0, atol=1e-5)
    np.testing.assert_allclose(got, golden(name)["logits"], rtol=0, atol=1e-4)


def test_gguf_without_the_qk_permutation_gives_other_logits(tmp_path, hf_logits):
    """The round trip above would notice a missing or wrong unpermute."""
    path = write_gguf(tmp_path / "plain.gguf", "llama_tied", permute=False)
    got = golden_forward(build_model(*load_gguf(path)), "llama_tied")
    assert np.abs(got - hf_logits("llama_tied")).max() > 1e-2


def test_gguf_q8_0_round_trip_is_close(gguf_files):
    name = "llama3_untied"
    path = gguf_files(name, "q8_0")
    types = {t.name: t.tensor_type for t in open_gguf(path).tensors}
    assert types["blk.0.attn_q.weight"] == Q8_0
    assert types["blk.0.ffn_down.weight"] == gguf.GGMLQuantizationType.F16  # 48 columns
    cfg, params = load_gguf(path)
    _, hf_params = load_hf_dir(GOLDEN / name)
    for k in params:  # Q8_0: |error| <= half a step of max|block| / 127
        np.testing.assert_allclose(params[k], hf_params[k], rtol=0,
                                   atol=0.5 * np.abs(hf_params[k]).max() / 127 + 1e-6,
                                   err_msg=str(k))
    got = golden_forward(build_model(cfg, params), name)
    want = golden(name)["logits"]
    np.testing.assert_allclose(got, want, rtol=0, atol=0.02 * np.abs(want).max())
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9


def test_load_model_on_a_gguf_returns_model_and_tokenizer(gguf_files, hf_logits):
    path = gguf_files("llama_tied")
    model, tok = load_model(path)
    assert tok.vocab_size == 128 and (tok.bos_id, tok.eos_id) == (1, 2)
    assert model.config.bos_id == 1 and model.config.eos_ids == (2,)
    text = "the cat sat on a mat, and then it rested."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text)  # merges were applied
    special = tok.encode("<|im_start|>the<|im_end|>", allow_special=True)
    assert (special[0], special[-1]) == (1, 2) and special[1:-1] == tok.encode("the")
    logits = forward(model, [ids])
    assert logits.shape == (1, len(ids), 128) and np.isfinite(logits).all()
    # the same numbers as the HF-directory model on these ids
    hf_model = build_model(*load_hf_dir(GOLDEN / "llama_tied"))
    np.testing.assert_allclose(logits, forward(hf_model, [ids]), rtol=0, atol=1e-5)
    # load_weights also dispatches a file to the GGUF loader
    cfg, _ = load_weights(path)
    assert cfg == model.config


def test_gguf_qwen2_is_not_unpermuted(gguf_files):
    """arch qwen2: llama.cpp writes Q/K as in HF; the loader must not unpermute them."""
    cfg, params = load_gguf(gguf_files("qwen2_tied"))
    _, hf_params = load_hf_dir(GOLDEN / "qwen2_tied")
    for k in [("layers", 0, "attn", "q_proj", "kernel"), ("layers", 1, "attn", "k_proj", "bias")]:
        np.testing.assert_array_equal(params[k], hf_params[k])


# ----------------------------------------------------------------------------- bfloat16


def test_bfloat16_build_tracks_float32(hf_logits):
    cfg, params = load_hf_dir(GOLDEN / "llama3_untied")
    model = build_model(cfg, params, jnp.bfloat16)
    dtypes = {x.dtype for x in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}
    got = golden_forward(model, "llama3_untied")
    want = hf_logits("llama3_untied")
    assert got.dtype == np.float32
    assert np.abs(got - want).max() > 0  # really computed in lower precision
    np.testing.assert_allclose(got, want, rtol=0, atol=0.05 * np.abs(want).max())
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.8


def test_bfloat16_build_is_float32_on_bfloat16_rounded_operands(monkeypatch):
    """The bf16 build computes a float32 model on bf16-rounded weights whose matmuls round
    their inputs to bf16 (products of bf16 numbers are exact in float32), to float32
    rounding: the exact statement behind "tracks float32" above (see tests/test_llama.py)."""
    from kvjax.core import cpu_kernel
    cfg, params = load_hf_dir(GOLDEN / "llama3_untied")
    assert not cfg.tie_embeddings  # logits go through lm_head, a Dense: `matmuls` covers them
    got = golden_forward(build_model(cfg, params, jnp.bfloat16), "llama3_untied")
    rounded = {k: np.asarray(jnp.asarray(v).astype(jnp.bfloat16).astype(jnp.float32))
               for k, v in params.items()}
    monkeypatch.setattr(cpu_kernel, "matmuls", lambda x, ws: tuple(jnp.dot(
        x.astype(jnp.bfloat16).astype(jnp.float32), w, preferred_element_type=jnp.float32)
        for w in ws))
    want = golden_forward(build_model(cfg, rounded), "llama3_untied")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# ----------------------------------------------------------------------------- errors


def test_missing_gguf_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(path)


def test_non_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a gguf file\n" * 64)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_gguf(path)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_model(path)


def test_gguf_with_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported.*'gpt2'"):
        load_gguf(path)
    with pytest.raises(ValueError, match="unsupported"):
        gguf_config(open_gguf(path))


def test_gguf_missing_tensor(tmp_path):
    path = write_gguf(tmp_path / "short.gguf", "llama_tied", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight"):
        load_gguf(path)


def test_hf_dir_with_unsupported_model_type(tmp_path):
    d = copy_hf_dir("llama_tied", tmp_path / "bert")
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "model_type": "bert"}))
    with pytest.raises(ValueError, match="unsupported model_type 'bert'"):
        load_hf_dir(d)


def test_hf_dir_without_config_or_weights(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_dir(tmp_path / "empty")
    d = copy_hf_dir("llama_tied", tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf_dir(d)


@pytest.mark.parametrize("missing", ["model.layers.1.mlp.up_proj.weight",
                                     "lm_head.weight"])  # the untied checkpoint's head
def test_hf_dir_missing_a_tensor(tmp_path, missing):
    d = copy_hf_dir("llama3_untied", tmp_path / "missing")
    tensors = load_file(str(d / "model.safetensors"))
    del tensors[missing]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=missing.replace(".", r"\.")):
        load_hf_dir(d)


def test_hf_dir_with_a_tensor_of_the_wrong_shape(tmp_path):
    d = copy_hf_dir("llama_tied", tmp_path / "badshape")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"][:32]
    save_file(tensors, str(d / "model.safetensors"))
    cfg, params = load_hf_dir(d)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.q_proj\.kernel.*\(64, 32\).*\(64, 64\)"):
        build_model(cfg, params)


def test_hf_dir_with_an_unexpected_tensor(tmp_path):
    d = copy_hf_dir("llama_tied", tmp_path / "extra")
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(16, np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="q_norm"):
        load_hf_dir(d)


def test_build_model_names_missing_and_unexpected_weights():
    cfg, params = load_hf_dir(GOLDEN / "llama_tied")
    params = dict(params)
    del params[("layers", 1, "mlp", "up_proj", "kernel")]
    params[("layers", 0, "attn", "o_proj", "bias")] = np.zeros(64, np.float32)
    with pytest.raises(ValueError, match=r"missing.*'up_proj'.*unexpected.*'o_proj', 'bias'"):
        build_model(cfg, params)


def test_smollm2_env_var_pointing_nowhere(tmp_path, monkeypatch):
    from models.hub import find_smollm2
    missing = tmp_path / "SmolLM2.gguf"
    monkeypatch.setenv("KVJAX_SMOLLM2", str(missing))
    with pytest.raises(FileNotFoundError, match="KVJAX_SMOLLM2"):
        find_smollm2()
    with pytest.raises(FileNotFoundError, match="SmolLM2.gguf"):
        resolve_model_path("smollm2")


def test_unknown_model_path_mentions_smollm2():
    with pytest.raises(FileNotFoundError, match="smollm2") as info:
        resolve_model_path("no/such/path")
    assert "no/such/path" in str(info.value)
    with pytest.raises(FileNotFoundError, match="smollm2"):
        load_model("no/such/path")


def test_converted_store_reloads_identically(gguf_files, tmp_path, monkeypatch):
    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "cache"))
    path = gguf_files("llama3_untied")
    first, tok_first = load_model(path)
    stored = models.loading.converted_dir(Path(path))
    assert (stored / "weights.safetensors").is_file() and (stored / "tokenizer.json").is_file()
    monkeypatch.setattr(models.loading, "load_gguf", None)  # a second load must not parse the GGUF
    second, tok_second = load_model(path)
    assert second.config == first.config
    np.testing.assert_array_equal(forward(second, [[1, 2, 3]]), forward(first, [[1, 2, 3]]))
    text = "hello <|im_start|> world 123"
    assert tok_second.encode(text) == tok_first.encode(text)
    assert (tok_second.bos_id, tok_second.eos_id, tok_second.chat_template) == (
        tok_first.bos_id, tok_first.eos_id, tok_first.chat_template)
