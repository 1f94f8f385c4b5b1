"""Tests for experiments.eval.passkey: passkey-retrieval prompts on real prose.

They use the real SmolLM2-135M-Instruct tokenizer but not its weights: from
the converted store next to the GGUF (tokenizer.json, well under a second) when
`load_model` has filled it, else from the GGUF file (about 5 s); the
`smollm2_tokenizer` fixture of conftest.py fetches the model if it is missing.
"""

from __future__ import annotations

import re

import pytest

from experiments.eval.passkey import (ANSWER_PREFIX, DATA_DIR, INSTRUCTION, NEEDLE, QUESTION,
                                 PasskeyTrial, make_trials, parse_answer, score_trials)

LENGTHS = [1024, 2048, 4096]
DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def trials_by_length(tok) -> dict[int, list[PasskeyTrial]]:
    return {n: make_trials(tok, n, DEPTHS, trials_per_depth=1, seed=0) for n in LENGTHS}


def key_position(trial: PasskeyTrial, tok) -> int:
    """Token index of the first occurrence of the key's digits (one token each) in context."""
    digits = tok.encode(trial.answer)
    starts = [i for i in range(len(trial.context) - len(digits) + 1)
              if trial.context[i:i + len(digits)] == digits]
    assert starts, "key not found in the context"
    return starts[0]


@pytest.mark.parametrize("length", LENGTHS)
def test_context_length_is_on_target(trials_by_length, length):
    trials = trials_by_length[length]
    assert len(trials) == len(DEPTHS)
    for t in trials:
        assert t.length == length
        assert abs(len(t.context) - length) <= 0.01 * length, len(t.context)


@pytest.mark.parametrize("length", LENGTHS)
def test_needle_appears_once_at_the_requested_depth(trials_by_length, tok, length):
    for t, depth in zip(trials_by_length[length], DEPTHS):
        assert t.depth == depth
        text = tok.decode(t.context)
        needle = NEEDLE.format(key=t.answer)
        assert text.count(needle) == 1
        assert text.count(t.answer) == 2  # both mentions are inside the needle
        assert abs(key_position(t, tok) / len(t.context) - depth) <= 0.1


def test_key_and_prompt_text(trials_by_length, tok):
    for t in trials_by_length[1024]:
        assert re.fullmatch(r"[1-9]\d{4}", t.answer)
        assert t.prompt == t.context + t.question
        full = tok.decode(t.context + t.question, skip_special_tokens=False)
        assert NEEDLE.format(key=t.answer) in full
        assert QUESTION in full
        assert full.startswith("<|im_start|>system\n")
        assert f"<|im_start|>user\n{INSTRUCTION}\n\n" in full
        assert full.endswith(f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n{ANSWER_PREFIX}")
        # the ids are exactly the encoding of the rendered text (byte-level BPE decodes losslessly)
        assert tok.encode(full, allow_special=True) == t.context + t.question


def test_question_is_the_tail_after_the_haystack(trials_by_length, tok):
    questions = {tuple(t.question) for n in LENGTHS for t in trials_by_length[n]}
    assert len(questions) == 1  # the same for every trial
    question = tok.decode(trials_by_length[1024][0].question, skip_special_tokens=False)
    assert question == f"\n\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n{ANSWER_PREFIX}"
    for t in trials_by_length[2048]:
        context = tok.decode(t.context)
        assert re.search(r"""[.!?]["')\]]*$""", context), context[-80:]  # ends on a sentence
        haystack = context.split(f"{INSTRUCTION}\n\n", 1)[1]
        assert re.match(r"""["'(\[]?[A-Z0-9]""", haystack), haystack[:80]  # starts on one


def test_matches_the_chat_template(trials_by_length, tok):
    t = trials_by_length[1024][2]
    text = tok.decode(t.context)
    haystack = text.split(f"{INSTRUCTION}\n\n", 1)[1]
    content = f"{INSTRUCTION}\n\n{haystack}\n\n{QUESTION}"
    rendered = tok.apply_chat_template([{"role": "user", "content": content}])
    assert tok.encode(rendered + ANSWER_PREFIX, allow_special=True) == t.context + t.question


def test_deterministic_for_a_seed_and_different_across_seeds(tok, trials_by_length):
    again = make_trials(tok, 1024, DEPTHS, trials_per_depth=1, seed=0)
    assert again == trials_by_length[1024]
    other = make_trials(tok, 1024, DEPTHS, trials_per_depth=1, seed=1)
    assert [t.answer for t in other] != [t.answer for t in again]
    assert all(a.context != b.context for a, b in zip(other, again))


def test_several_trials_per_depth_and_other_texts(tok):
    trials = make_trials(tok, 512, [0.3, 0.7], trials_per_depth=3, seed=5,
                         text_paths=[DATA_DIR / "kjv_genesis.txt"])
    assert [t.depth for t in trials] == [0.3] * 3 + [0.7] * 3
    assert len({t.answer for t in trials}) == 6
    for t in trials:
        assert abs(len(t.context) - 512) <= 5
        assert "ABASEMENT" not in tok.decode(t.context)  # no Devil's Dictionary


def test_rejects_bad_depths(tok):
    with pytest.raises(ValueError, match="depths"):
        make_trials(tok, 1024, [1.5], trials_per_depth=1)


@pytest.mark.parametrize("text, expected", [
    ("The pass key is 12345.", "12345"),
    (" 12345", "12345"),
    ("12345", "12345"),
    (" 54321 is the pass key. 12345", "54321"),
    ("no digits at all", None),
    ("", None),
    ("1234", None),
    (" 1234.", None),
    ("123456", None),
    ("12:34 and 56789", "56789"),
])
def test_parse_answer(text, expected):
    assert parse_answer(text) == expected


def test_score_trials():
    trial = PasskeyTrial(context=[1], question=[2], answer="40712", depth=0.5, length=1)
    other = PasskeyTrial(context=[1], question=[2], answer="11111", depth=0.5, length=1)
    assert score_trials([trial, other, trial], [" 40712.", " 40713", ""]) == [True, False, False]
    with pytest.raises(ValueError):
        score_trials([trial], [])


def test_rejects_a_corpus_shorter_than_the_context(tok, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("A short text. Another sentence.\n")
    with pytest.raises(ValueError, match="too short"):
        make_trials(tok, 256, [0.5], trials_per_depth=1, text_paths=[short])
