"""Make tiny random Hugging Face checkpoints + transformers' logits for the loader tests.

What it makes
-------------
``tests/golden/tiny_hf/<name>/`` for three tiny, randomly initialised models,
each written by ``transformers`` itself (``save_pretrained(...,
safe_serialization=True)``: ``config.json``, ``model.safetensors``,
``generation_config.json``) plus ``logits.npz``:

* ``llama_tied``: ``LlamaForCausalLM``, tied embeddings, default RoPE
  (theta 10 000);
* ``llama3_untied``: ``LlamaForCausalLM``, separate ``lm_head``, Llama-3 RoPE
  scaling (factor 8, low/high freq factor 1/4, original context 64, theta
  500 000: with head_dim 16 the frequencies fall in all three bands: kept,
  smoothed and divided by the factor);
* ``qwen2_tied``: ``Qwen2ForCausalLM`` (q/k/v biases), tied, theta 1e6.

All: hidden 64, intermediate 48, 2 layers, 4 query / 2 KV heads (head_dim 16),
vocab 128, float32, eager attention. The weights are drawn from a seeded
normal with std 1/8 (about 1/sqrt(hidden), so the logits are O(1) rather than
the O(0.01) of the default 0.02 init); the RMSNorm weights (1 at init) and the
q/k/v biases (0 at init) are perturbed so that loading them wrongly shows.

``logits.npz`` holds ``input_ids`` int64 [2, 10] (seeded, fixed),
``position_ids`` int64 [2, 10] (row 0 starts at 0, row 1 at 37, so RoPE is
exercised beyond the first few positions), ``logits`` float32 [2, 10, 128]
(``model(input_ids, position_ids=position_ids).logits``, no padding, no
cache), ``transformers_version``, ``torch_version``.

Each directory is < 300 KB. The tests (``tests/test_loading.py``) load the
directories with ``models.loading.load_hf_dir`` and compare logits; they also
rebuild GGUF files from the same weights.

How to run
----------
    pip install -e '.[compare]'
    python experiments/golden/make_tiny_hf.py [--out tests/golden/tiny_hf]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[2] / "tests" / "golden" / "tiny_hf"

COMMON = dict(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=128,
              initializer_range=0.125, bos_token_id=1, eos_token_id=2, pad_token_id=None)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

MODELS = {
    # name: (class name, config kwargs, seed)
    "llama_tied": ("llama", dict(tie_word_embeddings=True, rope_theta=10_000.0,
                                 rms_norm_eps=1e-5), 0),
    "llama3_untied": ("llama", dict(tie_word_embeddings=False, rope_theta=500_000.0,
                                    rope_scaling=LLAMA3_ROPE, rms_norm_eps=1e-5), 1),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1_000_000.0,
                                 rms_norm_eps=1e-6, use_sliding_window=False), 2),
}

BATCH, SEQ, SECOND_ROW_START = 2, 10, 37


def make(name: str, kind: str, kwargs: dict, seed: int, out: Path) -> None:
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                             "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    config = config_cls(**COMMON, **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()

    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):  # RMSNorm weights: ones at init
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif pname.endswith(".bias"):  # Qwen2 q/k/v biases: zeros at init
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.125 * torch.randn(p.shape, generator=gen))
    if kwargs["tie_word_embeddings"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, COMMON["vocab_size"], size=(BATCH, SEQ), dtype=np.int64)
    position_ids = np.stack([np.arange(SEQ), np.arange(SEQ) + SECOND_ROW_START]).astype(np.int64)
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(input_ids),
                       position_ids=torch.from_numpy(position_ids)).logits
    logits = logits.float().numpy()
    assert logits.shape == (BATCH, SEQ, COMMON["vocab_size"])

    target = out / name
    if target.exists():
        shutil.rmtree(target)
    model.save_pretrained(target, safe_serialization=True)
    np.savez(target / "logits.npz", input_ids=input_ids, position_ids=position_ids,
             logits=logits, transformers_version=np.array(transformers.__version__),
             torch_version=np.array(torch.__version__))
    size = sum(f.stat().st_size for f in target.iterdir())
    assert size < 300_000, f"{target} is {size} bytes"
    print(f"{name}: {sorted(f.name for f in target.iterdir())}, {size / 1000:.0f} KB, "
          f"logits std {logits.std():.2f}, max |logit| {np.abs(logits).max():.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    import torch
    torch.set_num_threads(2)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (kind, kwargs, seed) in MODELS.items():
        make(name, kind, kwargs, seed, args.out)


if __name__ == "__main__":
    main()
