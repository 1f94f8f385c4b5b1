"""Make tiny random checkpoints of each model family + transformers' logits and greedy tokens.

What it makes
-------------
``tests/golden/families/<name>/`` for one tiny, randomly initialised model per
family, each written by ``transformers`` itself (``save_pretrained(...,
safe_serialization=True)``: ``config.json``, ``model.safetensors``,
``generation_config.json``) plus ``golden.npz``:

* ``llama3``: ``LlamaForCausalLM``, untied, Llama-3 RoPE scaling (factor 8, original
  context 64, theta 500 000: the frequencies fall in all three bands);
* ``qwen2``: ``Qwen2ForCausalLM`` (q/k/v biases), tied;
* ``qwen3``: ``Qwen3ForCausalLM`` (q/k RMSNorm, head_dim 64 != hidden / heads);
* ``mistral_sw``: ``MistralForCausalLM`` with ``sliding_window`` 48;
* ``gemma3``: ``Gemma3ForCausalLM`` (text): layers sliding / full / sliding,
  window 40, RoPE bases 10 000 (local) and 1e6 with linear scaling 8 (global),
  ``query_pre_attn_scalar`` 24, final logit soft-capping 30, tied;
* ``phi3``: ``Phi3ForCausalLM`` (fused qkv and gate/up), ``sliding_window`` 64;
* ``gemma3_multimodal``: ``Gemma3ForConditionalGeneration`` (how Gemma 3 4B-27B ship)
  holding ``gemma3``'s text weights without final soft-capping and a tiny random vision
  tower; its ``golden.npz`` has ``input_ids`` and ``logits`` (text only) and no greedy tokens.

Common shapes: hidden 64, 2 query heads sharing 1 KV head of 32 (the codecs'
default channel group), vocab 128, float32, eager attention. The weights are drawn from a seeded normal with std 1/8; norm
weights are perturbed around their init (1, or 0 for Gemma's (1 + w) norms)
and biases are non-zero (std 0.1), so that loading them wrongly shows.

``golden.npz`` holds ``input_ids`` int64 [1, 272] (seeded), ``logits`` float32
[1, 272, 128] (``model(input_ids).logits``: positions 0-271, no cache, every
window crossed many times), ``prompt_len`` (200) and ``greedy`` int64 [32]:
``model.generate(input_ids[:, :200], do_sample=False, max_new_tokens=32)`` with no
end token (an end token is generated, not suppressed), transformers' own cached decoding, plus the versions and
the ``seed`` used (the first of seed, seed + 100, ... whose greedy tokens hold
at least 8 distinct ids, else the one of the first 20 with the most: tiny random
models often repeat one token).

The tests (``tests/test_families.py``) load the directories with
``models.loading.load_model`` and compare, without transformers.

How to run
----------
    pip install -e '.[compare]'
    python experiments/golden/make_families.py [--out tests/golden/families]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[2] / "tests" / "golden" / "families"

COMMON = dict(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, vocab_size=128, max_position_embeddings=512,
              initializer_range=0.125, bos_token_id=1, eos_token_id=2, pad_token_id=None)

MODELS = {
    # name: (family, config kwargs, seed)
    "llama3": ("llama", dict(tie_word_embeddings=False, rms_norm_eps=1e-5, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=500_000.0), 15),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1_000_000.0,
                            rms_norm_eps=1e-6, use_sliding_window=False), 10),
    "qwen3": ("qwen3", dict(tie_word_embeddings=True, rope_theta=1_000_000.0, head_dim=64,
                            rms_norm_eps=1e-6, use_sliding_window=False), 11),
    "mistral_sw": ("mistral", dict(tie_word_embeddings=False, rope_theta=10_000.0,
                                   sliding_window=48, rms_norm_eps=1e-5), 12),
    "gemma3": ("gemma3_text", dict(
        tie_word_embeddings=True, num_hidden_layers=3, intermediate_size=32, head_dim=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=40, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
        attn_logit_softcapping=None, rms_norm_eps=1e-6,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        pad_token_id=0), 13),
    "phi3": ("phi3", dict(tie_word_embeddings=False, rope_theta=10_000.0, sliding_window=64,
                          rms_norm_eps=1e-5, original_max_position_embeddings=512), 14),
    # Phi-3 long-context RoPE: short factors up to 32 positions, long ones past them
    "phi3_longrope": ("phi3", dict(
        tie_word_embeddings=False, rope_theta=10_000.0, sliding_window=None, rms_norm_eps=1e-5,
        original_max_position_embeddings=32, rope_scaling={
            "rope_type": "longrope",
            "short_factor": [round(1.0 + 0.5 * i / 15, 4) for i in range(16)],
            "long_factor": [round(1.0 + 7.0 * i / 15, 4) for i in range(16)]}), 16),
}
SWITCH_PROMPT, SWITCH_END = 20, 40  # longrope: prefill 20 tokens (short), then 1 a call to 40

SEQ, PROMPT, NEW = 272, 200, 32


def classes(family: str):
    import transformers as tf
    return {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
            "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
            "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
            "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM)}[family]


DISTINCT, ATTEMPTS = 8, 20  # greedy tokens' distinct ids wanted, seeds tried (see `make`)


def make(name: str, family: str, kwargs: dict, seed: int, out: Path) -> None:
    """Write the checkpoint and golden of the first of seeds `seed`, `seed + 100`, ... whose
    32 greedy tokens hold at least `DISTINCT` distinct ids, else of the one of the first
    `ATTEMPTS` with the most: random tiny models often settle into repeating one token,
    which would make the greedy comparison weak."""
    best = None
    for attempt in range(ATTEMPTS):
        model, arrays = draw(family, kwargs, seed + 100 * attempt)
        distinct = len(set(arrays["greedy"].tolist()))
        if best is None or distinct > best[0]:
            best = (distinct, seed + 100 * attempt, model, arrays)
        if distinct >= DISTINCT:
            break
    _, seed, model, arrays = best
    target = out / name
    if target.exists():
        shutil.rmtree(target)
    model.save_pretrained(target, safe_serialization=True)
    np.savez(target / "golden.npz", seed=np.array(seed), **arrays)
    size = max(f.stat().st_size for f in target.iterdir())
    assert size < 400_000, f"a file of {target} is {size} bytes"
    print(f"{name}: seed {seed}, {sorted(f.name for f in target.iterdir())}, "
          f"largest file {size / 1000:.0f} KB, logits std {arrays['logits'].std():.2f}, "
          f"greedy {arrays['greedy'].tolist()}")


def draw(family: str, kwargs: dict, seed: int):
    """(model, golden arrays) of one seeded random model."""
    import torch
    import transformers

    config_cls, model_cls = classes(family)
    config = config_cls(**{**COMMON, **kwargs})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()

    gen = torch.Generator().manual_seed(1000 + seed)
    gemma = family == "gemma3_text"
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("norm.weight", "layernorm.weight")):  # ones (Gemma: zeros) at init
                p.copy_((0.0 if gemma else 1.0) + 0.3 * torch.randn(p.shape, generator=gen))
            elif pname.endswith(".bias"):  # Qwen2 q/k/v biases: zeros at init
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.125 * torch.randn(p.shape, generator=gen))
    if kwargs["tie_word_embeddings"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    rng = np.random.default_rng(seed)
    input_ids = rng.integers(3, COMMON["vocab_size"], size=(1, SEQ), dtype=np.int64)
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(input_ids)).logits.float().numpy()
        prompt = torch.from_numpy(input_ids[:, :PROMPT])
        eos = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = None  # plain argmax: an end token is a token
        greedy = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                max_new_tokens=NEW, pad_token_id=0)
        model.generation_config.eos_token_id = eos
    greedy = greedy[0, PROMPT:].numpy()
    assert logits.shape == (1, SEQ, COMMON["vocab_size"]) and greedy.shape == (NEW,)
    extra = {}
    if (kwargs.get("rope_scaling") or {}).get("rope_type") == "longrope":
        extra["switch_logits"] = call_by_call_logits(model, input_ids[:, :SWITCH_END])
    return model, dict(input_ids=input_ids, logits=logits, prompt_len=np.array(PROMPT),
                       greedy=greedy, transformers_version=np.array(transformers.__version__),
                       torch_version=np.array(torch.__version__), **extra)


def call_by_call_logits(model, ids: np.ndarray) -> np.ndarray:
    """[1, T, V] logits of `SWITCH_PROMPT` tokens in one call, then one token a call with the
    cache: the model's forward decides LongRoPE's factors per call (short while its positions
    fit `original_max_position_embeddings`), so the cache holds keys of both. (transformers'
    Phi-3 `generate` instead recomputes the whole cache once at the crossing.)"""
    import torch
    ids = torch.from_numpy(ids)
    with torch.no_grad():
        out = model(input_ids=ids[:, :SWITCH_PROMPT], use_cache=True)
        cache, logits = out.past_key_values, [out.logits]
        for i in range(SWITCH_PROMPT, ids.shape[1]):
            out = model(input_ids=ids[:, i:i + 1], past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[i]]))
            cache = out.past_key_values
            logits.append(out.logits)
    return torch.cat(logits, dim=1).float().numpy()


def make_multimodal(out: Path) -> None:
    """``gemma3_multimodal/``: a ``Gemma3ForConditionalGeneration`` (the class of the released
    4B-27B Gemma 3) whose text model holds the tiny ``gemma3`` weights, without final
    soft-capping (as the released configs; transformers 5.2's multimodal class would not
    apply it anyway), and a tiny random SigLIP vision tower; ``golden.npz``: its text-only
    logits over ``gemma3``'s 272 ids."""
    import torch
    import transformers as tf

    text = tf.Gemma3ForCausalLM.from_pretrained(out / "gemma3", dtype=torch.float32).eval()
    vision = tf.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, image_size=32, patch_size=16)
    text_config = {**text.config.to_dict(), "final_logit_softcapping": None}
    config = tf.Gemma3Config(text_config=text_config, vision_config=vision.to_dict(),
                             mm_tokens_per_image=4, eos_token_id=2, bos_token_id=1)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(config).float().eval()
    model.model.language_model.load_state_dict(text.model.state_dict())
    golden = np.load(out / "gemma3" / "golden.npz")
    ids = torch.from_numpy(golden["input_ids"])
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().numpy()
        text.config.final_logit_softcapping = None  # the text class without the cap agrees
        plain = text(input_ids=ids).logits.float().numpy()
    assert np.abs(logits - plain).max() <= 1e-6 * np.abs(plain).max()
    target = out / "gemma3_multimodal"
    if target.exists():
        shutil.rmtree(target)
    model.save_pretrained(target, safe_serialization=True)
    np.savez(target / "golden.npz", input_ids=golden["input_ids"], logits=logits,
             transformers_version=np.array(tf.__version__),
             torch_version=np.array(torch.__version__))
    size = max(f.stat().st_size for f in target.iterdir())
    print(f"gemma3_multimodal: {sorted(f.name for f in target.iterdir())}, largest file "
          f"{size / 1000:.0f} KB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("names", nargs="*", default=[*MODELS, "gemma3_multimodal"])
    args = parser.parse_args()
    import torch
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names:
        if name == "gemma3_multimodal":
            make_multimodal(args.out)
            continue
        family, kwargs, seed = MODELS[name]
        make(name, family, kwargs, seed, args.out)


if __name__ == "__main__":
    main()
