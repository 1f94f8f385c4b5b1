"""`ask(..., questions=[...])`: one context compressed once, many questions answered from
copies of its cache -- the same tokens as one `ask` per question, the context prefilled and
compressed once (counted at the sampler's compiled prefill and compression), bad arguments
named. A random-weight model of the tiny shape with SmolLM2's vocabulary, the real tokenizer."""

from __future__ import annotations

import pytest

import models.sampler as sampler
from models.pipeline import Answer, ask

CONTEXT = ("The lighthouse keeper wrote in his log every evening. On the third night the fog "
           "came in from the sea and the lamp burned until dawn. The keeper's cat was grey.")
QUESTIONS = ["When did the fog come?", "What colour was the cat?",
             "Who wrote in the log every evening, and what burned until dawn?"]


@pytest.fixture(scope="module")
def vocab_model():
    from flax import nnx
    from models.llama import Llama, LlamaConfig
    return Llama(LlamaConfig.tiny(vocab_size=49152, max_position=1024), rngs=nnx.Rngs(1))


@pytest.fixture
def counted(monkeypatch):
    """Widths of every compiled prefill call and the number of compressions made."""
    calls = {"prefill_widths": [], "compressions": 0}
    prefill, compress = sampler._prefill, sampler._compress_stacked

    def counting_prefill(model, tokens, *args, **kwargs):
        calls["prefill_widths"].append(tokens.shape)
        return prefill(model, tokens, *args, **kwargs)

    def counting_compress(*args, **kwargs):
        calls["compressions"] += 1
        return compress(*args, **kwargs)

    monkeypatch.setattr(sampler, "_prefill", counting_prefill)
    monkeypatch.setattr(sampler, "_compress_stacked", counting_compress)
    return calls


# snapkv and streaming_llm tile into one batch; kivi (encoded layers) and h2o (mass) take the
# one-copy-per-question path or the tiled one with the mass leaf: both must equal single calls
@pytest.mark.parametrize("method", ["full", "snapkv:ratio=0.5", "streaming_llm:sinks=4,window=16",
                                    "kivi:bits=4,group=16", "h2o:ratio=0.5"])
def test_questions_answer_as_separate_calls_and_compress_once(vocab_model, smollm2_tokenizer,
                                                              method, counted):
    model, tok = vocab_model, smollm2_tokenizer
    kw = dict(context=CONTEXT, method=method, answer_prefix="It", max_new_tokens=6)
    alone = [ask(model, tok, q, **kw) for q in QUESTIONS]
    alone_compressions = counted["compressions"]
    counted["prefill_widths"].clear()
    counted["compressions"] = 0
    many = ask(model, tok, questions=QUESTIONS, **kw)
    assert all(isinstance(a, Answer) for a in many) and len(many) == 3
    assert [a.tokens for a in many] == [a.tokens for a in alone]
    assert [a.text for a in many] == [a.text for a in alone]
    assert [(a.context_tokens, a.question_tokens) for a in many] == \
        [(a.context_tokens, a.question_tokens) for a in alone]
    context_width = alone[0].context_tokens
    # one prefill covers the context (batch 1); every other call is a question suffix
    context_prefills = [s for s in counted["prefill_widths"] if s[1] >= context_width]
    assert context_prefills == [(1, context_width)], counted["prefill_widths"]
    assert counted["compressions"] == alone_compressions // 3 == (0 if method == "full" else 1)


def test_questions_are_batched_when_the_cache_tiles(vocab_model, smollm2_tokenizer, counted):
    """A dense cache is tiled: the three questions extend one batch of 3 in one prefill call."""
    ask(vocab_model, smollm2_tokenizer, questions=QUESTIONS, context=CONTEXT,
        method="snapkv:ratio=0.5", max_new_tokens=2)
    assert [s[0] for s in counted["prefill_widths"]] == [1, 3]


def test_bad_questions_name_the_argument(vocab_model, smollm2_tokenizer):
    model, tok = vocab_model, smollm2_tokenizer
    with pytest.raises(ValueError, match="questions: need at least one"):
        ask(model, tok, questions=[], context=CONTEXT)
    with pytest.raises(TypeError, match=r"questions\[1\] must be a str, got int"):
        ask(model, tok, questions=["a", 3], context=CONTEXT)
    with pytest.raises(TypeError, match="questions must be a list of str, got str"):
        ask(model, tok, questions="When?", context=CONTEXT)
    with pytest.raises(TypeError, match="either question .* or questions"):
        ask(model, tok, "a", questions=["b"], context=CONTEXT)
    with pytest.raises(TypeError, match="either question"):
        ask(model, tok, context=CONTEXT)
    with pytest.raises(TypeError, match="context must be a str, got bytes"):
        ask(model, tok, questions=["a"], context=b"bytes")
