"""The first four RULER-style task generators (RULER's whole set: tests/test_ruler_set.py):
on-target lengths, answers present exactly as often as the task says, the chat split,
determinism, and the scorer. Real SmolLM2 tokenizer, no weights."""

from __future__ import annotations

import re

import pytest

from experiments.eval.ruler import LEGACY_TASKS, SLACK, TaskTrial, make_task_trials, score


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def trials(tok):
    return {(task, n): make_task_trials(tok, task, n, trials=2, seed=1)
            for task in LEGACY_TASKS for n in (1024, 2048)}


def occurrences(text: str, s: str) -> int:
    return len(re.findall(rf"(?<!\w){re.escape(s)}(?!\w)", text))


@pytest.mark.parametrize("task", LEGACY_TASKS)
@pytest.mark.parametrize("length", [1024, 2048])
def test_contexts_are_on_target_and_answers_appear_as_specified(trials, tok, task, length):
    for t in trials[task, length]:
        assert length - SLACK <= len(t.context) <= length
        text = tok.decode(t.context)
        question = tok.decode(t.question)
        if task == "niah_multikey":
            (answer,) = t.answers
            assert re.fullmatch(r"\d{7}", answer) and occurrences(text, answer) == 1
            key = re.search(r"special magic number for (\w+)", question).group(1)
            assert f"magic numbers for {key} is: {answer}." in text  # the asked key's needle
            assert len(re.findall(r"special magic numbers for \w+ is: \d{7}\.", text)) == 4
        elif task == "niah_multivalue":
            assert len(t.answers) == 4 and len(set(t.answers)) == 4
            key = re.search(r"magic numbers for (\w+)", question).group(1)
            for a in t.answers:
                assert f"magic numbers for {key} is: {a}." in text and occurrences(text, a) == 1
        elif task == "variable_tracking":
            value = re.search(r"assigned the value (\d+)", question).group(1)
            assert occurrences(text, value) == 1 and len(t.answers) == 5
            holder = {value}
            for line in re.findall(r"VAR (\w+) = (VAR \w+|\d+)", text):  # follow the chain
                if line[1].removeprefix("VAR ") in holder:
                    holder.add(line[0])
            assert holder - {value} == set(t.answers)
        else:
            listed = re.findall(r"\d+\. (\w+)", text)
            counts = {w: listed.count(w) for w in set(listed)}
            top = sorted(counts, key=counts.get, reverse=True)[:10]
            assert set(top) == set(t.answers)
            assert min(counts[w] for w in t.answers) > max(
                c for w, c in counts.items() if w not in t.answers)


def test_prompt_is_the_encoded_chat(trials, tok):
    t = trials["niah_multikey", 1024][0]
    rendered = tok.decode(t.prompt, skip_special_tokens=False)
    assert tok.encode(rendered, allow_special=True) == t.prompt  # the template's control ids
    assert rendered.rstrip().endswith("mentioned in the provided text is")


def test_seeded_and_different_across_seeds(tok, trials):
    again = make_task_trials(tok, "variable_tracking", 1024, trials=2, seed=1)
    assert [t.prompt for t in again] == [t.prompt for t in trials["variable_tracking", 1024]]
    other = make_task_trials(tok, "variable_tracking", 1024, trials=2, seed=2)
    assert other[0].answers != again[0].answers


def test_score_is_the_fraction_of_answers_found():
    t = TaskTrial("niah_multivalue", [], [], ("1234567", "7654321"), 0)
    assert score(t, "are 1234567 and 7654321.") == 1.0
    assert score(t, "are 1234567 and 1111111.") == 0.5
    assert score(t, "I do not know.") == 0.0


def test_bad_options_raise(tok):
    with pytest.raises(ValueError, match="unknown task"):
        make_task_trials(tok, "trivia", 1024, 1)
    with pytest.raises(ValueError, match="more often"):
        make_task_trials(tok, "common_words", 1024, 1, freq=2, rare=2)
