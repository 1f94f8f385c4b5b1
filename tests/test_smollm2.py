"""The real SmolLM2-135M-Instruct against Hugging Face transformers (golden file).

`experiments/golden/make_smollm2.py` (needs the `compare` extra) ran the same
GGUF through transformers in float32 and stored token ids, logits, a
perplexity and a greedy continuation; these tests need only that file.
"""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.eval.ppl import perplexity
from models.llama import new_cache
from models.sampler import generate

GOLDEN = np.load(Path(__file__).parent / "golden" / "smollm2_golden.npz", allow_pickle=False)
PROMPTS = sorted({int(k[6]) for k in GOLDEN.files if k.startswith("prompt") and k.endswith("_ids")})


def forward(model, ids):
    t = len(ids)
    logits, _ = model(jnp.asarray(ids)[None], jnp.arange(t)[None], new_cache(model.config, 1, t))
    return np.asarray(logits[0])


@pytest.mark.parametrize("i", PROMPTS)
def test_logits_match_transformers(smollm2, i):
    model, _ = smollm2
    logits = forward(model, GOLDEN[f"prompt{i}_ids"])
    cols = GOLDEN["logit_cols"]
    np.testing.assert_allclose(logits[:, cols], GOLDEN[f"prompt{i}_logits_cols"], rtol=0, atol=1e-3)
    np.testing.assert_allclose(logits[-1], GOLDEN[f"prompt{i}_last_logits"], rtol=0, atol=1e-3)
    np.testing.assert_array_equal(logits.argmax(-1), GOLDEN[f"prompt{i}_argmax"])


def test_tokenizer_matches_transformers_on_digit_free_prompts(smollm2):
    _, tokenizer = smollm2
    for i in PROMPTS:
        # the golden texts are rendered chat prompts, encoded by transformers with their
        # control tokens parsed: trusted text, so the explicit opt-in
        assert tokenizer.encode(str(GOLDEN[f"prompt{i}_text"]),
                                allow_special=True) == GOLDEN[f"prompt{i}_ids"].tolist()


def test_perplexity_matches_transformers(smollm2):
    model, _ = smollm2
    result = perplexity(model, GOLDEN["ppl_ids"], int(GOLDEN["ppl_context"]),
                        int(GOLDEN["ppl_stride"]), batch_size=4, chunk=128)
    assert result.tokens_scored == int(GOLDEN["ppl_tokens_scored"])
    assert abs(result.ppl / float(GOLDEN["ppl_value"]) - 1) < 1e-3


def test_greedy_chat_generation_is_token_identical(smollm2):
    model, tokenizer = smollm2
    prompt = GOLDEN["greedy_prompt_ids"].tolist()
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write one sentence about the sea."}])
    assert rendered == str(GOLDEN["greedy_prompt_text"])
    assert tokenizer.encode_chat(
        [{"role": "user", "content": "Write one sentence about the sea."}]) == prompt
    want = GOLDEN["greedy_new_ids"].tolist()
    out = generate(model, [prompt], max_new_tokens=len(want))
    assert out.tokens[0, :out.num_tokens[0]].tolist() == want


def test_batched_generation_equals_single_on_real_model(smollm2):
    model, tokenizer = smollm2
    prompts = [tokenizer.encode(t) for t in (
        "The Devil's Dictionary defines a cynic as",
        "In the beginning God created the heaven and the earth. And the earth was",
        "1, 2, 3, 4,")]
    batch = generate(model, prompts, max_new_tokens=12, eos_ids=())
    for i, p in enumerate(prompts):
        alone = generate(model, [p], max_new_tokens=12, eos_ids=())
        assert batch.tokens[i].tolist() == alone.tokens[0].tolist()
