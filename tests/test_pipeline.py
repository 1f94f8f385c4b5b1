"""models.pipeline: the prompt split, `ask` against the sampler it wraps, batches against single
questions, and bad arguments (real SmolLM2 model and tokenizer)."""

from __future__ import annotations

import pytest

import kvjax
from models.pipeline import Answer, ask, ask_batch, chat_prompt
from models.sampler import generate

CONTEXT = ("The lighthouse keeper wrote in his log every evening. On the third night the fog "
           "came in from the sea and the lamp burned until dawn.")


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("prefix", ["", "The answer is"])
def test_chat_prompt_cuts_after_the_context(smollm2_tokenizer, chat, prefix):
    tok = smollm2_tokenizer
    head, ids = chat_prompt(tok, "When did the fog come?", CONTEXT, answer_prefix=prefix,
                            chat=chat)
    whole = tok.decode(head + ids, skip_special_tokens=False)
    assert tok.decode(head, skip_special_tokens=False).endswith(CONTEXT)
    ending = "assistant\n" + prefix if chat else "When did the fog come?" + (
        "\n" + prefix if prefix else "")
    assert whole.endswith(ending)
    assert ("<|im_start|>user" in whole) == chat
    none, alone = chat_prompt(tok, "Hi", answer_prefix=prefix, chat=chat)
    alone_text = tok.decode(alone, skip_special_tokens=False)
    assert none == [] and alone_text.endswith(prefix or ("assistant\n" if chat else "Hi"))


@pytest.mark.slow
def test_ask_is_generate_on_the_split_prompt_and_batches_like_single_questions(smollm2):
    model, tok = smollm2
    method = "streaming_llm:sinks=4,window=16"
    head, ids = chat_prompt(tok, "When did the fog come?", CONTEXT, answer_prefix="It came")
    want = generate(model, [ids], contexts=[head], max_new_tokens=6,
                    transform=kvjax.parse_method(method))
    one = ask(model, tok, "When did the fog come?", context=CONTEXT, method=method,
              answer_prefix="It came", max_new_tokens=6)
    assert isinstance(one, Answer) and one.tokens == want.tokens[0, :want.num_tokens[0]].tolist()
    assert one.text == tok.decode(one.tokens) and str(one) == one.text
    assert (one.context_tokens, one.question_tokens) == (len(head), len(ids))
    assert one.cache_bytes == kvjax.nbytes(one.cache) and "cache=" not in repr(one)
    short = "The lamp was red."
    batch = ask_batch(model, tok, ["When did the fog come?", "What colour was the lamp?"],
                      [CONTEXT, short], method=method, answer_prefix="It came",
                      max_new_tokens=6)
    alone = ask(model, tok, "What colour was the lamp?", context=short, method=method,
                answer_prefix="It came", max_new_tokens=6)
    assert batch[0].tokens == one.tokens and batch[1].tokens == alone.tokens


def test_bad_arguments_name_the_argument(tiny_model, smollm2_tokenizer):
    tok = smollm2_tokenizer
    with pytest.raises(ValueError, match="contexts: 1 contexts for 2 questions"):
        ask_batch(tiny_model, tok, ["a", "b"], ["c"])
    with pytest.raises(ValueError, match="questions: need at least one"):
        ask_batch(tiny_model, tok, [])
    with pytest.raises(ValueError, match="contexts: give a context for every question or for none"):
        ask_batch(tiny_model, tok, ["a", "b"], ["c", None])
    with pytest.raises(ValueError, match="unknown method"):
        ask(tiny_model, tok, "a", method="nope")


@pytest.mark.slow
def test_cli_answer_prefix_finds_the_pass_key(capsys, tmp_path, smollm2_file):
    """`kvjax generate --answer-prefix` is `ask` on the command line: with the reply opened by
    the prefix, the full cache reads the number out of a context it saw before the question."""
    import json

    from experiments.cli.main import main

    context = tmp_path / "context.txt"
    context.write_text("There is a pass key hidden in this note. The pass key is 58213. "
                       "Remember it. " + "The grass is green and the sky is blue. " * 20)
    code = main(["generate", "--model", str(smollm2_file), "--chat", "--context-file",
                 str(context), "--prompt", "What is the pass key?", "--answer-prefix",
                 "The pass key is", "--max-new-tokens", "8", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert "58213" in result["text"] and result["context_tokens"] > 0
