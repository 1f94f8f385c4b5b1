"""RULER-style synthetic tasks on real prose, defined here (no downloads).

Four tasks after RULER (Hsieh et al., 2024), each a chat prompt split like
the passkey task (`experiments.passkey`): `context` (instruction and
haystack, at most `length` tokens and at least `length - slack` of them,
what a compression method prefills and compresses) and `question` (the
question, the assistant prompt and an answer prefix).

| task | the haystack hides | the question asks | answers |
|---|---|---|---|
| `niah_multikey` | `keys` needles "One of the special magic numbers for WORD is: NNNNNNN." with different words | the number of one word | 1 |
| `niah_multivalue` | `values` needles for the same word | all its numbers | `values` |
| `variable_tracking` | a chain "VAR ABCDE = 12345." then "VAR FGHIJ = VAR ABCDE ." ... | every variable holding 12345 | `hops + 1` |
| `common_words` | (no prose) a numbered list where `common` words appear `freq` times and the rest `rare` times | the `common` most frequent words | `common` |

Needles go at random depths between sentences of the prose (The Devil's
Dictionary, then Genesis); words come from the same prose. Every answer
(number, variable, common word) occurs in the context exactly as often as
the task says, which the generators assert. `score` is RULER's
`string_match_all`: the fraction of answers found in the generated text.

Example::

    trials = make_task_trials(tok, "niah_multikey", length=1024, trials=10, seed=0)
    out = generate(model, [t.context + t.question for t in trials], max_new_tokens=32)
    texts = [tok.decode(row[:n]) for row, n in zip(out.tokens, out.num_tokens)]
    accuracy = sum(score(t, x) for t, x in zip(trials, texts)) / len(trials)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from experiments.passkey import _tokenized, load_corpus, render

TASKS = ("niah_multikey", "niah_multivalue", "variable_tracking", "common_words")
SLACK = 64  # a context may fall short of `length` by at most this many tokens (sentence steps)

NIAH_INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make "
                    "sure to memorize it. I will quiz you about the numbers afterwards.")
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."
VT_INSTRUCTION = ("Memorize and track the chain(s) of variable assignment hidden in the "
                  "following text.")
CWE_INSTRUCTION = ("Below is a numbered list of words. In these words, some appear more "
                   "often than others. Memorize the ones that appear most often.")


@dataclass(frozen=True)
class TaskTrial:
    task: str
    context: list[int]  # int[<= length]: chat opening + instruction + haystack
    question: list[int]  # question + end of user turn + assistant prompt + answer prefix
    answers: tuple[str, ...]  # what a correct answer contains
    length: int  # requested context tokens

    @property
    def prompt(self) -> list[int]:
        return self.context + self.question


def score(trial: TaskTrial, text: str) -> float:
    """Fraction of the trial's answers that occur in `text` (case-insensitive)."""
    text = text.lower()
    return sum(a.lower() in text for a in trial.answers) / len(trial.answers)


def _check_counts(tokenizer, context: list[int], counts: dict[str, int]) -> None:
    """Each pattern occurs in the decoded context exactly `counts[p]` times (word-bounded)."""
    text = tokenizer.decode(context)
    for pattern, want in counts.items():
        got = len(re.findall(rf"(?<!\w){re.escape(pattern)}(?!\w)", text))
        if got != want:
            raise AssertionError(f"{pattern!r} occurs {got} times in the context, not {want}")


def _words(rng: np.random.Generator, n: int, avoid: str = "") -> list[str]:
    """n distinct lowercase words of 5-9 letters from the prose, none of them in `avoid`."""
    vocab = sorted(set(re.findall(r"\b[a-z]{5,9}\b", load_corpus().text))
                   - set(re.findall(r"\w+", avoid.lower())))
    return [vocab[i] for i in rng.choice(len(vocab), n, replace=False)]


def _numbers(rng: np.random.Generator, n: int, digits: int) -> list[str]:
    low = 10 ** (digits - 1)
    return [str(x) for x in rng.choice(np.arange(low, 10 * low), n, replace=False)]


def _names(rng: np.random.Generator, n: int) -> list[str]:
    letters = np.array(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"))
    names: list[str] = []
    while len(names) < n:
        name = "".join(rng.choice(letters, 5))
        if name not in names:
            names.append(name)
    return names


def _prose_with(tokenizer, length: int, inserts: Sequence[tuple[float, str]], instruction: str,
                question: str, prefix: str, rng: np.random.Generator, attempts: int = 16,
                text_paths: tuple[str, ...] | None = None):
    """(context, question ids): prose from a random sentence on, `inserts` (depth, sentence)
    placed at the sentence boundaries nearest their depths, as many sentences as fit
    `length` tokens (binary search). A start whose sentences cannot come within SLACK
    tokens of `length` (a very long sentence at the cut) is replaced by another."""
    corpus = load_corpus(text_paths)
    text, starts, tok_at = _tokenized(tokenizer, corpus)

    def build(first, j):
        bounds = tok_at[first:j + 1] - tok_at[first]
        at: dict[int, list[str]] = {}
        for depth, sentence in sorted(inserts):
            at.setdefault(int(np.argmin(np.abs(bounds - depth * bounds[-1]))), []).append(sentence)
        parts = []
        for k in range(j - first + 1):
            parts += at.get(k, [])
            if k < j - first:
                parts.append(text[starts[first + k]:starts[first + k + 1] - 1])
        return render(tokenizer, " ".join(parts), instruction, question, prefix)

    for _ in range(attempts):
        first = int(rng.integers(len(corpus.starts)))
        lo = first + 1
        hi = int(np.searchsorted(tok_at, tok_at[first] + length, side="right"))
        while lo < hi:  # the most sentences whose context fits
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if len(build(first, mid)[0]) <= length else (lo, mid - 1)
        context, q = build(first, lo)
        if length - SLACK <= len(context) <= length:
            return context, q
    raise ValueError(f"could not fit a {length}-token context in {attempts} tries "
                     f"(last: {len(context)} tokens)")


def _niah(tokenizer, length, rng, keys: int, values: int, multivalue: bool,
          text_paths: tuple[str, ...] | None = None):
    words = _words(rng, keys)
    numbers = _numbers(rng, keys * values, 7)
    needles = [(float(rng.random()), NIAH_NEEDLE.format(key=words[i // values], value=n))
               for i, n in enumerate(numbers)]
    key = words[0]
    if multivalue:
        question = f"What are all the special magic numbers for {key} mentioned in the provided text?"
        prefix = f"The special magic numbers for {key} mentioned in the provided text are"
    else:
        question = f"What is the special magic number for {key} mentioned in the provided text?"
        prefix = f"The special magic number for {key} mentioned in the provided text is"
    context, q = _prose_with(tokenizer, length, needles, NIAH_INSTRUCTION, question, prefix, rng,
                             text_paths=text_paths)
    _check_counts(tokenizer, context, {n: 1 for n in numbers})
    return context, q, tuple(numbers[:values])


def _variable_tracking(tokenizer, length, rng, hops: int,
                       text_paths: tuple[str, ...] | None = None):
    names = _names(rng, hops + 1)
    value = _numbers(rng, 1, 5)[0]
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a} ." for a, b in
                                             zip(names, names[1:])]
    depths = np.sort(rng.random(len(chain)))
    question = f"Find all variables that are assigned the value {value} in the text above."
    prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, "
              f"{len(names)} variables are assigned the value {value}, they are:")
    context, q = _prose_with(tokenizer, length, list(zip(depths, chain)), VT_INSTRUCTION,
                             question, prefix, rng, text_paths=text_paths)
    _check_counts(tokenizer, context, {value: 1, **{f"VAR {n} =": 1 for n in names}})
    return context, q, tuple(names)


def _common_words(tokenizer, length, rng, common: int, freq: int, rare: int):
    question = f"What are the {common} most common words in the above list?"
    prefix = f"Answer: The top {common} words that appear most often in the list are:"
    chat = tokenizer.apply_chat_template(  # system turn, instruction and question
        [{"role": "user", "content": f"{CWE_INSTRUCTION} {question}"}]) + prefix
    words = _words(rng, common + 4096, avoid=chat)
    top, others = words[:common], words[common:]

    def build(n_rare):
        items = top * freq + others[:n_rare] * rare
        order = np.random.default_rng(int(rng.integers(2 ** 31))).permutation(len(items))
        body = " ".join(f"{i + 1}. {items[k]}" for i, k in enumerate(order))
        return render(tokenizer, body, CWE_INSTRUCTION, question, prefix)

    lo, hi = 0, len(others)  # the most rare words that fit: binary search on the token count
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(build(mid)[0]) <= length else (lo, mid - 1)
    context, q = build(lo)
    if not length - SLACK <= len(context) <= length:
        raise ValueError(f"could not fit a {length}-token word list (got {len(context)})")
    _check_counts(tokenizer, context, {w: freq for w in top} | {w: rare for w in others[:lo]})
    return context, q, tuple(top)


def make_task_trials(tokenizer, task: str, length: int, trials: int, seed: int = 0, *,
                     keys: int = 4, values: int = 4, hops: int = 4, common: int = 10,
                     freq: int = 8, rare: int = 2,
                     text_paths: Sequence[str] | None = None) -> list[TaskTrial]:
    """`trials` seeded trials of `task` with contexts of `length - SLACK .. length` tokens.

    `text_paths` replaces the built-in haystack prose (the needle tasks and
    variable tracking; common_words is a word list).

    Options: `keys` (niah_multikey needles), `values` (niah_multivalue
    numbers), `hops` (variable_tracking chain length after the first
    assignment), `common`/`freq`/`rare` (common_words: how many frequent
    words, and how often frequent and other words appear).
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {TASKS}")
    if task == "common_words" and freq <= rare:
        raise ValueError(f"common words must appear more often than the rest ({freq} <= {rare})")
    rng = np.random.default_rng(seed)
    paths = None if text_paths is None else tuple(str(p) for p in text_paths)
    build = {
        "niah_multikey": lambda: _niah(tokenizer, length, rng, keys, 1, False, paths),
        "niah_multivalue": lambda: _niah(tokenizer, length, rng, 1, values, True, paths),
        "variable_tracking": lambda: _variable_tracking(tokenizer, length, rng, hops, paths),
        "common_words": lambda: _common_words(tokenizer, length, rng, common, freq, rare),
    }[task]
    out = []
    for _ in range(trials):
        context, question, answers = build()
        out.append(TaskTrial(task, context, question, answers, length))
    return out
