"""RULER's synthetic tasks (Hsieh et al., 2024) on the project's own texts (no downloads).

Every trial is a chat prompt split like the passkey task (`experiments.eval.passkey`):
`context` (instruction and haystack: what a compression method prefills and compresses) and
`question` (the question, the assistant prompt and RULER's answer prefix); `context + question`
is token for token the encoded chat. `make(task, tokenizer, context_tokens, seed, depth=None)`
gives one trial as `(context ids, question ids, answers)`, from the seed alone;
`make_task_trials` gives `TaskTrial`s, which `kvjax eval` runs (experiments/eval/cells.py).

RULER's task set (`RULER_TASKS`; its 13 tasks with one QA task for its two): contexts of
`context_tokens - TOLERANCE[task] .. context_tokens` tokens (16 except where noted).

| task | haystack | needles | answers | metric |
|---|---|---|---|---|
| `niah_single_1` | noise: "The grass is green. ..." lines | 1: "One of the special magic numbers for KEY is: 7 digits." | 1 | all |
| `niah_single_2` | essay: the shipped prose, whole sentences | 1 (7 digits) | 1 | all |
| `niah_single_3` | essay | 1 (a UUID value) | 1 | all |
| `niah_multikey_1` | essay | 4 keys, 1 asked | 1 | all |
| `niah_multikey_2` | needles: every line a needle for another key (tolerance 48) | 1 | 1 | all |
| `niah_multikey_3` | needles, UUID keys and values (tolerance 96) | 1 | 1 | all |
| `niah_multivalue` | essay (the first four tasks' generator; tolerance 64) | 4 values of 1 key | 4 | all |
| `niah_multiquery` | essay | 4 keys, all asked | 4 | all |
| `vt` | RULER's one-shot example, then noise | a chain "VAR ABCDE = 12345", "VAR FGHIJ = VAR ABCDE", 4 hops | 5 names | all |
| `cwe` | a one-shot example, then a numbered word list: 10 words 30x, the rest 3x (6x/1x below 4096 tokens; tolerance 32) | - | 10 words | all |
| `fwe` | coded 6-letter words, Zipf (alpha 2) over `context_tokens // 50` of them, the first "..." | - | words 2-4 | all |
| `qa` | "Document i:" entries of The Devil's Dictionary; the question quotes one entry's first definition sentence (unique in the dictionary) | the answering entry | its headword | part |

NIAH keys are two prose words ("solemn-throne", RULER: adjective-noun) or UUIDs; values
7-digit numbers or UUIDs; every value and key occurs exactly once. `depth` (0..1) puts the
first answer's needle (vt: the first assignment, the rest after it; qa: the answering
document) at that fraction of the haystack; None draws it as RULER does. Each generator
asserts its invariants (length, needle and answer counts, the chain, the word counts).
Metrics (`METRIC`, `score`): RULER's `string_match_all` (the fraction of the answers found
in the cleaned-up output, case-insensitive) for all but `qa`, `string_match_part` (any
answer found) for `qa`; `string_match_all(preds, refs)` / `string_match_part` give RULER's
0-100 aggregate. `TOKENS_TO_GENERATE` is RULER's answer budget per task.

The first four tasks (`LEGACY_TASKS`, results recorded before the set existed; their draws
are unchanged):

| task | the haystack hides | the question asks | answers |
|---|---|---|---|
| `niah_multikey` | `keys` needles with different single-word keys in prose | the number of one word | 1 |
| `niah_multivalue` | `values` needles for the same word | all its numbers | `values` |
| `variable_tracking` | a chain "VAR ABCDE = 12345." ... in prose | every variable holding 12345 | `hops + 1` |
| `common_words` | (no prose) a list: `common` words `freq` times, the rest `rare` times | the `common` most frequent words | `common` |

Their contexts are `length - SLACK .. length` tokens; needles go at random depths between
sentences of the prose (The Devil's Dictionary, then Genesis).

Example::

    trials = make_task_trials(tok, "niah_single_2", length=4096, trials=10, seed=0)
    out = generate(model, [t.question for t in trials], contexts=[t.context for t in trials],
                   max_new_tokens=TOKENS_TO_GENERATE["niah_single_2"])
    texts = [tok.decode(row[:n]) for row, n in zip(out.tokens, out.num_tokens)]
    accuracy = sum(score(t, x) for t, x in zip(trials, texts)) / len(trials)
"""

from __future__ import annotations

import functools
import re
import uuid
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from experiments.eval.passkey import DATA_DIR, _tokenized, load_corpus, render

LEGACY_TASKS = ("niah_multikey", "niah_multivalue", "variable_tracking", "common_words")
RULER_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
               "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery",
               "vt", "cwe", "fwe", "qa")
TASKS = LEGACY_TASKS + tuple(t for t in RULER_TASKS if t not in LEGACY_TASKS)
SLACK = 64  # a context may fall short of `length` by at most this many tokens (sentence steps)
# RULER's metric per task: every answer counts (`string_match_all`) or any one does (`_part`)
METRIC = {t: "string_match_all" for t in TASKS} | {"qa": "string_match_part"}
# how many tokens a context may fall short of its target: a word (or list item) at most for
# the RULER set, one distractor needle where the haystack is needles, a sentence for the
# first four tasks
TOLERANCE = {t: SLACK for t in LEGACY_TASKS} \
    | {t: 16 for t in RULER_TASKS if t not in LEGACY_TASKS} \
    | {"niah_multikey_2": 48, "niah_multikey_3": 96, "cwe": 32}
# RULER's tokens_to_generate per task (what a config's max_new_tokens should allow)
TOKENS_TO_GENERATE = {t: 128 for t in TASKS if t.startswith("niah")} | {
    "variable_tracking": 30, "vt": 30, "common_words": 120, "cwe": 120, "fwe": 50, "qa": 32}

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
    depth: float | None = None  # RULER set: where the first answer's needle sits (0..1)

    @property
    def prompt(self) -> list[int]:
        return self.context + self.question


def postprocess_pred(text: str) -> str:
    """RULER's cleanup of a generated answer: control characters become newlines, stripped."""
    return re.sub(r"[\x00-\x1f]", "\n", text.strip()).strip()


def match_all(pred: str, refs: Sequence[str]) -> float:
    """One prediction under `string_match_all`: the fraction of `refs` found in it
    (case-insensitive substrings)."""
    if not refs:
        raise ValueError("refs: need at least one reference answer, got none")
    pred = pred.lower()
    return sum(r.lower() in pred for r in refs) / len(refs)


def match_part(pred: str, refs: Sequence[str]) -> float:
    """One prediction under `string_match_part`: 1.0 when any of `refs` is found in it."""
    if not refs:
        raise ValueError("refs: need at least one reference answer, got none")
    pred = pred.lower()
    return float(any(r.lower() in pred for r in refs))


def _ruler_metric(one, preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    if isinstance(preds, str) or len(preds) != len(refs) or not preds:
        raise ValueError(f"preds and refs: need equally many (at least one), got "
                         f"{'a str' if isinstance(preds, str) else len(preds)} and {len(refs)}")
    return round(100 * sum(one(p, r) for p, r in zip(preds, refs)) / len(preds), 2)


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's `string_match_all` (0-100, two decimals): per prediction the fraction of its
    references it contains, averaged. NIAH, variable tracking, CWE and FWE."""
    return _ruler_metric(match_all, preds, refs)


def string_match_part(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's `string_match_part` (0-100, two decimals): per prediction 1 when it contains
    any of its references, averaged. The QA tasks."""
    return _ruler_metric(match_part, preds, refs)


def score(trial: TaskTrial, text: str) -> float:
    """The trial's score 0..1 by its task's RULER metric (`METRIC`) on the cleaned-up text."""
    one = match_part if METRIC[trial.task] == "string_match_part" else match_all
    return one(postprocess_pred(text), trial.answers)


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
          text_paths: tuple[str, ...] | None = None, depth: float | None = None):
    words = _words(rng, keys)
    numbers = _numbers(rng, keys * values, 7)
    needles = [(float(rng.random()), NIAH_NEEDLE.format(key=words[i // values], value=n))
               for i, n in enumerate(numbers)]
    if depth is not None:  # the first answer's needle there (the draws stay the same)
        needles[0] = (float(depth), needles[0][1])
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
                     text_paths: Sequence[str] | None = None,
                     depth: float | None = None) -> list[TaskTrial]:
    """`trials` seeded trials of `task` with contexts of `length - TOLERANCE[task] .. length`
    tokens. RULER-set tasks draw trial i from its own seed (the i-th draw of
    `default_rng(seed)`), so trial i is the same whatever `trials` is; `depth` (0..1) puts
    each trial's first answer needle there (see `make`).

    `text_paths` replaces the built-in haystack prose (the needle tasks and
    variable tracking; common_words is a word list).

    Options of the first four tasks (the RULER set has RULER's counts): `keys`
    (niah_multikey needles), `values` (niah_multivalue numbers), `hops`
    (variable_tracking chain length after the first assignment),
    `common`/`freq`/`rare` (common_words: how many frequent words, and how often
    frequent and other words appear).
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {TASKS}")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials={trials!r}: must be an integer >= 1")
    if task not in LEGACY_TASKS or depth is not None:  # RULER set: one seed per trial
        seeds = np.random.default_rng(seed).integers(2 ** 31, size=trials)
        out = []
        for s in seeds:
            context, question, answers, at = _make(task, tokenizer, length, int(s), depth,
                                                   text_paths)
            out.append(TaskTrial(task, context, question, answers, length, at))
        return out
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


# ============================================================================ RULER's task set
#
# Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
# Models?", its 13 tasks less the second QA set (HotpotQA), rebuilt from the shipped texts.

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = np.linspace(0.0, 1.0, 40)  # RULER draws needle depths from 40 even steps
MIN_LENGTH = 256  # the smallest context the RULER set builds (instruction + a few needles)

# (haystack, key kind, value kind, keys, values per key, keys asked), as RULER's synthetic.yaml
NIAH_SPECS = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
    "niah_multiquery": ("essay", "words", "numbers", 4, 1, 4),
}

FWE_INSTRUCTION = ("Read the following coded text and track the frequency of each coded word. "
                   "Find the three most frequently appeared coded words.")
FWE_QUESTION = ("Question: Do not provide any explanation. Please ignore the dots '....'. What "
                "are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = ("Answer: According to the coded text above, the three most frequently appeared "
              "words are:")
QA_INSTRUCTION = ("Answer the question based on the given documents. Only give me the answer and "
                  "do not output any other words.")
QA_PREFIX = "Answer:"
DICTIONARY = DATA_DIR / "devils_dictionary.txt"


def _check_length(n: int, length: int, tolerance: int, task: str) -> None:
    if not length - tolerance <= n <= length:
        raise AssertionError(f"{task}: the context has {n} tokens, not {length - tolerance}.."
                             f"{length} (context_tokens={length}, tolerance {tolerance})")


def _occurrences(text: str, s: str) -> int:
    return len(re.findall(rf"(?<![\w-]){re.escape(s)}(?![\w-])", text))


def _check_once(tokenizer, context: list[int], needles: Sequence[str], task: str) -> str:
    """Each of `needles` occurs exactly once in the decoded context; returns that text."""
    text = tokenizer.decode(context)
    for s in needles:
        got = _occurrences(text, s)
        if got != 1:
            raise AssertionError(f"{task}: {s!r} occurs {got} times in the context, not once")
    return text


def _assemble(units: Sequence[str], sep: str, inserts: Sequence[tuple[float, str]]) -> str:
    """`units` joined by `sep` with each (depth, text) of `inserts` placed at the unit
    boundary whose character offset is nearest `depth` times the units' length (0: first,
    1: last); inserts at one boundary keep their order."""
    bounds = np.cumsum([0] + [len(u) + len(sep) for u in units])
    at: dict[int, list[str]] = {}
    for depth, text in sorted(inserts, key=lambda x: x[0]):  # stable: a chain keeps its order
        at.setdefault(int(np.argmin(np.abs(bounds - depth * bounds[-1]))), []).append(text)
    parts: list[str] = []
    for k in range(len(units) + 1):
        parts += at.get(k, [])
        if k < len(units):
            parts.append(units[k])
    return sep.join(parts)


def _largest(fits, lo: int, hi: int, guess: int | None = None) -> int:
    """The largest n in [lo, hi] with fits(n), given fits(lo) and that fits is monotone
    (true up to some n, false after). A `guess` near the answer narrows the bracket first
    (steps doubling away from it), so a good guess costs a few calls of `fits`."""
    if guess is not None and lo < hi:
        guess, step = min(max(guess, lo), hi), 1 + (hi - lo) // 256
        if fits(guess):
            lo = guess
            while lo < hi:
                probe = min(lo + step, hi)
                if not fits(probe):
                    hi = probe - 1
                    break
                lo, step = probe, 2 * step
        else:
            hi = guess - 1
            while lo < hi:
                probe = max(hi - step, lo)
                if fits(probe):
                    lo = probe
                    break
                hi, step = probe - 1, 2 * step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _count_for(sizes: Sequence[int], chars: float) -> int:
    """How many items of character `sizes`, from the first, fit in `chars` characters."""
    return int(np.searchsorted(np.cumsum(sizes), chars, side="right"))


def _fit(tokenizer, length: int, units: Sequence[str], tail_words: bool, compose, task: str):
    """(context, question) ids with as many `units` as fit `length` context tokens, then (with
    `tail_words`) as many words of the next unit. `compose(units) -> (context, question)`.
    Both counts are searched from a guess at the tokens-per-character rate of a first probe."""
    built: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def build(n, w=0):
        if (n, w) not in built:
            body = list(units[:n])
            if w:
                body.append(" ".join(units[n].split()[:w]))
            built[n, w] = compose(body)
        return built[n, w]

    base = len(build(0)[0])
    if base > length:
        raise ValueError(f"{task}: context_tokens={length} is too small for the instruction "
                         f"and needles alone ({base} tokens)")
    sizes = [len(u) + 1 for u in units]
    probe_at = min(max(_count_for(sizes, 3.5 * (length - base)), 1), len(units) - 1)
    rate = max(len(build(probe_at)[0]) - base, 1) / sum(sizes[:probe_at])  # tokens per char
    n = _largest(lambda m: len(build(m)[0]) <= length, 0, len(units) - 1,
                 _count_for(sizes, (length - base) / rate))
    if n == len(units) - 1:  # the next unit (for a tail) must exist, and more might have fit
        raise ValueError(f"{task}: the haystack material ({len(units)} units) is too short for "
                         f"context_tokens={length}")
    w = 0
    if tail_words:
        words = units[n].split()
        guess = _count_for([len(x) + 1 for x in words] or [1],
                           (length - len(build(n)[0])) / rate)
        w = _largest(lambda m: len(build(n, m)[0]) <= length, 0, len(words), guess)
    return build(n, w)


@functools.lru_cache(maxsize=1)
def _vocabulary() -> tuple[str, ...]:
    """Lowercase words of 5-9 letters from the shipped prose, sorted."""
    return tuple(sorted(set(re.findall(r"\b[a-z]{5,9}\b", load_corpus().text))))


def _pick_words(rng: np.random.Generator, n: int, avoid: str = "") -> list[str]:
    """n distinct prose words, none in `avoid`, none a substring of another (so a word found in
    an answer is that word, not part of a longer one)."""
    banned = set(re.findall(r"\w+", avoid.lower()))
    vocab = _vocabulary()
    out: list[str] = []
    for i in rng.permutation(len(vocab)):
        word = vocab[i]
        if word in banned or any(word in o or o in word for o in out):
            continue
        out.append(word)
        if len(out) == n:
            return out
    raise ValueError(f"the prose has fewer than {n} usable distinct words")


def _keys(rng: np.random.Generator, kind: str, n: int) -> list[str]:
    """n distinct needle keys: "word-word" pairs of prose words (RULER: adjective-noun) or UUIDs."""
    if kind == "uuids":
        return _uuids(rng, n)
    words = _pick_words(rng, 2 * n)
    return [f"{a}-{b}" for a, b in zip(words[:n], words[n:])]


def _uuids(rng: np.random.Generator, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        u = str(uuid.UUID(bytes=rng.bytes(16), version=4))
        if u not in out:
            out.append(u)
    return out


def _values(rng: np.random.Generator, kind: str, n: int) -> list[str]:
    if kind == "uuids":
        return _uuids(rng, n)
    return [str(1_000_000 + int(x)) for x in rng.choice(9_000_000, n, replace=False)]


def _essay_units(rng: np.random.Generator, length: int, text_paths) -> list[str]:
    """Whole sentences of the prose from a random one on (wrapping around), enough for
    `length` tokens and a margin."""
    corpus = load_corpus(text_paths)
    first = int(rng.integers(len(corpus.starts)))
    # the tokenized corpus is per tokenizer; sentence lengths in characters suffice here
    text = corpus.text + " " + corpus.text
    starts = np.concatenate([corpus.starts, corpus.starts + len(corpus.text) + 1, [len(text) + 1]])
    units, chars = [], 0
    i = first
    while chars < 8 * length + 4000 and i < len(starts) - 1:  # ~4 characters per token
        units.append(text[starts[i]:starts[i + 1] - 1])
        chars += len(units[-1]) + 1
        i += 1
    return units


def _niah_ruler(task, tokenizer, length, rng, depth, text_paths):
    haystack, key_kind, value_kind, n_keys, n_values, n_queries = NIAH_SPECS[task]
    n_keys = max(n_keys, n_queries)
    keys = _keys(rng, key_kind, n_keys)
    values = _values(rng, value_kind, n_keys * n_values)
    kind = value_kind  # "numbers" / "uuids" in the needle, as RULER writes it
    needles = [(keys[i // n_values], v, NIAH_NEEDLE.replace("numbers", kind).format(
        key=keys[i // n_values], value=v)) for i, v in enumerate(values)]
    asked = [int(i) for i in rng.choice(n_keys, n_queries, replace=False)]
    answers = [v for i in asked for v in values[i * n_values:(i + 1) * n_values]]
    depths = [float(d) for d in
              rng.choice(DEPTHS, len(needles), replace=len(needles) > len(DEPTHS))]
    if depth is not None:  # the first answer's needle at `depth`, the others where drawn
        depths[values.index(answers[0])] = float(depth)
    inserts = [(d, text) for d, (_, _, text) in zip(depths, needles)]
    first_depth = depths[values.index(answers[0])]

    query = keys[asked[0]] if n_queries == 1 else \
        ", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]]
    one = n_queries * n_values == 1
    noun = kind[:-1] if one else kind
    instruction = (f"A special magic {noun} is hidden within the following text. Make sure to "
                   f"memorize it. I will quiz you about the {noun} afterwards." if one else
                   f"Some special magic {noun} are hidden within the following text. Make sure "
                   f"to memorize it. I will quiz you about the {noun} afterwards.")
    question = (f"What is the special magic {noun} for {query} mentioned in the provided text?"
                if one else
                f"What are all the special magic {noun} for {query} mentioned in the provided "
                f"text?")
    prefix = f"The special magic {noun} for {query} mentioned in the provided text " + \
        ("is" if one else "are")

    if haystack == "noise":
        units, sep, tail = [NOISE] * (length // 8 + 8), "\n", True
    elif haystack == "essay":
        units, sep, tail = _essay_units(rng, length, text_paths), " ", True
    else:  # every line a needle for another key (RULER's "needle" haystack)
        n = length // 12 + 8
        other = [k for k in _keys(rng, key_kind, n + n_keys) if k not in keys][:n]
        fill = [v for v in _values(rng, value_kind, n + len(values)) if v not in values][:n]
        units = [NIAH_NEEDLE.replace("numbers", kind).format(key=k, value=v)
                 for k, v in zip(other, fill)]
        sep, tail = "\n", False
    context, q = _fit(tokenizer, length, units, tail, lambda body: render(
        tokenizer, _assemble(body, sep, inserts), instruction, question, prefix), task)
    _check_length(len(context), length, TOLERANCE[task], task)
    _check_once(tokenizer, context, [t for _, _, t in needles] + values + keys, task)
    return context, q, tuple(answers), first_depth


def _vt_ruler(tokenizer, length, rng, depth, hops: int = 4):
    """RULER's `vt`: one chain of `hops` + 1 assignments in the noise haystack, after RULER's
    one-shot example (a short noise text with its own chain, question and answer: 12 noise
    lines, about 400 tokens, from 3072 context tokens on; fewer below, 2 at 512)."""
    example_lines = min(12, max(2, length // 256))
    names = _names(rng, 2 * (hops + 1))
    names, shown = names[:hops + 1], names[hops + 1:]
    value, shown_value = (str(v) for v in rng.choice(np.arange(10000, 100000), 2, replace=False))

    def chain_of(names, value):
        return [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in
                                               zip(names, names[1:])]

    def ask(value):
        return (f"Question: Find all variables that are assigned the value {value} in the "
                f"text above.", f"Answer: According to the chain(s) of variable assignment in "
                f"the text above, {hops + 1} variables are assigned the value {value}, they are:")

    shown_at = np.sort(rng.random(hops + 1))
    shown_q, shown_prefix = ask(shown_value)
    shown_text = _assemble([NOISE] * example_lines, "\n",
                           list(zip(shown_at, chain_of(shown, shown_value))))
    example = (f"{VT_INSTRUCTION}\n\n{shown_text}\n{shown_q} {shown_prefix} {' '.join(shown)}"
               f"\n\n{VT_INSTRUCTION}")
    chain = chain_of(names, value)
    start = float(depth) if depth is not None else float(rng.random())
    depths = [start] + sorted(float(x) for x in rng.uniform(start, 1.0, hops))
    question, prefix = ask(value)
    units = [NOISE] * (length // 8 + 8)
    context, q = _fit(tokenizer, length, units, True, lambda body: render(
        tokenizer, _assemble(body, "\n", list(zip(depths, chain))), example, question,
        prefix), "vt")
    _check_length(len(context), length, TOLERANCE["vt"], "vt")
    text = _check_once(tokenizer, context, [value] + [f"VAR {n} =" for n in names + shown], "vt")
    if _occurrences(text, shown_value) != 3:  # the example's chain, question and answer prefix
        raise AssertionError(f"vt: the example's value {shown_value} occurs "
                             f"{_occurrences(text, shown_value)} times, not 3")
    return context, q, tuple(names), start


def _word_list(words: Sequence[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _cwe_ruler(tokenizer, length, rng, common: int = 10):
    """RULER's `cwe`: a one-shot example, then a numbered list in which `common` words appear
    30 times and the others 3 times (6 and 1 below 4096 tokens, as RULER)."""
    small = length < 4096
    ex_total, ex_freq, ex_rare = (20, 3, 1) if small else (40, 10, 3)
    freq, rare = (6, 1) if small else (30, 3)
    question = f"Question: What are the {common} most common words in the above list?"
    prefix = f"Answer: The top {common} words that appear most often in the list are:"
    template = f"{CWE_INSTRUCTION} {question} {prefix}"
    pool = _pick_words(rng, ex_total + common + length // (2 * rare) + 16, avoid=template)
    ex_top, ex_rest = pool[:common], pool[common:ex_total]
    top, others = pool[ex_total:ex_total + common], pool[ex_total + common:]
    shuffle_seed = int(rng.integers(2 ** 31))
    ex_items = ex_top * ex_freq + ex_rest * ex_rare
    ex_items = [ex_items[k] for k in np.random.default_rng(shuffle_seed).permutation(len(ex_items))]
    example = (f"{_word_list(ex_items)}\n{question}\n{prefix} {_word_list(ex_top)}\n\n"
               f"{CWE_INSTRUCTION}\n")

    def compose(body):
        items = top * freq + [w for w in body for _ in range(rare)]
        order = np.random.default_rng(shuffle_seed + 1).permutation(len(items))
        return render(tokenizer, example + _word_list([items[k] for k in order]),
                      CWE_INSTRUCTION, question, prefix)

    context, q = _fit(tokenizer, length, others, False, compose, "cwe")
    _check_length(len(context), length, TOLERANCE["cwe"], "cwe")
    text = tokenizer.decode(context)
    listed = text[text.rindex(CWE_INSTRUCTION):]
    counts = {w: _occurrences(listed, w) for w in top + others}
    if any(counts[w] != freq for w in top) or any(c not in (0, rare) for w, c in counts.items()
                                                  if w not in top):
        raise AssertionError(f"cwe: the common words occur {[counts[w] for w in top]} times, "
                             f"not {freq}, or another word occurs other than {rare} times")
    return context, q, tuple(top), None


def _fwe_ruler(tokenizer, length, rng, alpha: float = 2.0, word_len: int = 6):
    """RULER's `fwe`: `length // 50` coded words, word k of them `N * k**-alpha / zeta(alpha)`
    times (Zipf), the first being the noise "..."; the answers are words 2-4."""
    vocab_size = max(length // 50, 8)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    banned = set(re.findall(r"\w+", f"{FWE_INSTRUCTION} {FWE_QUESTION} {FWE_PREFIX}".lower()))
    vocab: list[str] = []
    while len(vocab) < vocab_size - 1:
        w = "".join(rng.choice(letters, word_len))
        if w not in vocab and w not in banned:
            vocab.append(w)
    vocab = ["..."] + vocab
    zeta = float(np.sum(np.arange(1, 200_000, dtype=np.float64) ** -alpha)) + \
        1 / ((alpha - 1) * 200_000 ** (alpha - 1))  # zeta(alpha), tail by its integral
    shuffle_seed = int(rng.integers(2 ** 31))
    ranks = np.arange(1, vocab_size + 1, dtype=np.float64)

    def counts(n):
        return (n * ranks ** -alpha / zeta).astype(int)

    def compose(n):
        words = [w for w, c in zip(vocab, counts(n)) for _ in range(c)]
        order = np.random.default_rng(shuffle_seed).permutation(len(words))
        return render(tokenizer, " ".join(words[k] for k in order), FWE_INSTRUCTION,
                      FWE_QUESTION, FWE_PREFIX)

    built = {}

    def fits(n):
        if n not in built:
            built[n] = compose(n)
        return len(built[n][0]) <= length

    hi = 2 * length
    if fits(hi):
        raise AssertionError(f"fwe: {hi} words fit {length} tokens")
    base, probe = len(compose(0)[0]), length // 4  # tokens per word from a probe
    rate = max(len(compose(probe)[0]) - base, 1) / probe
    n = _largest(fits, 0, hi, int((length - base) / rate))
    context, q = built[n]
    _check_length(len(context), length, TOLERANCE["fwe"], "fwe")
    c = counts(n)
    if not (c[1] > c[2] > c[3] > c[4]):
        raise AssertionError(f"fwe: the counts {c[:5].tolist()} do not rank words 2-4 strictly "
                             f"(context_tokens={length} is too small)")
    text = tokenizer.decode(context)
    for w, want in zip(vocab[1:], c[1:]):
        if _occurrences(text, w) != want:
            raise AssertionError(f"fwe: {w!r} occurs {_occurrences(text, w)} times, not {want}")
    return context, q, tuple(vocab[1:4]), None


class _Entry(NamedTuple):
    headword: str  # "ABASEMENT"
    document: str  # the whole entry, whitespace collapsed
    clause: str  # its definition's first sentence when usable as a question, else ""


_HEAD = re.compile(r"([A-Z][A-Z'\-]*(?: [A-Z][A-Z'\-]*)*), ((?:[a-z]+\.)(?: ?[a-z]+\.)*)\s+(\S.*)",
                   re.S)


@functools.lru_cache(maxsize=1)
def dictionary_entries() -> tuple[_Entry, ...]:
    """The Devil's Dictionary as documents: one per entry (verse and citations included).

    An entry's `clause` is its definition's first sentence when that sentence has 6-30
    words, no double quote, does not contain the headword and occurs nowhere else in the
    dictionary: a question quoting it has exactly one document that answers it."""
    raw = DICTIONARY.read_text(encoding="utf-8")
    entries: list[list[str]] = []
    for block in raw.split("\n\n"):
        m = _HEAD.match(block)
        if m:
            entries.append([m.group(1), " ".join(block.split()), " ".join(m.group(3).split())])
        elif entries:  # verse or a citation under the entry above
            entries[-1][1] += " " + " ".join(block.split())
    whole = " ".join(e[1] for e in entries)
    out = []
    for head, document, definition in entries:
        m = re.match(r"(.+?[.!?])(?:\s|$)", definition)
        clause = m.group(1) if m else ""
        if not (6 <= len(clause.split()) <= 30) or '"' in clause or \
                head.lower() in clause.lower() or whole.count(clause) != 1:
            clause = ""
        out.append(_Entry(head, document, clause))
    return tuple(out)


def _qa_ruler(tokenizer, length, rng, depth):
    """A SQuAD-like QA task (RULER's qa_1) from The Devil's Dictionary: documents are entries;
    the question quotes one entry's first definition sentence and asks for its headword."""
    entries = dictionary_entries()
    golds = [i for i, e in enumerate(entries) if e.clause]
    gold = entries[golds[int(rng.integers(len(golds)))]]
    others, chars = [], 0
    for i in rng.permutation(len(entries)):  # enough distractors for `length` tokens and more
        if entries[int(i)].headword != gold.headword and chars < 8 * length + 4000:
            others.append(entries[int(i)])
            chars += len(others[-1].document)
    at = float(depth) if depth is not None else float(rng.choice(DEPTHS))
    question = (f"{QA_INSTRUCTION}\n\nQuestion: Which word do the documents define as "
                f"\"{gold.clause}\"?")
    marker = "\x00gold\x00"

    def compose(body):
        docs = _assemble(body, "\x01", [(at, marker)]).split("\x01")
        docs = [gold.document if d == marker else d for d in docs]
        text = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
        return render(tokenizer, text, f"{QA_INSTRUCTION}\n\nThe following are given documents.",
                      question, QA_PREFIX)

    context, q = _fit(tokenizer, length, [e.document for e in others], True, compose, "qa")
    _check_length(len(context), length, TOLERANCE["qa"], "qa")
    text = _check_once(tokenizer, context, [gold.clause], "qa")
    if not re.search(rf"Document \d+:\n{re.escape(gold.document)}(\n|$)", text):
        raise AssertionError(f"qa: the answering entry {gold.headword!r} is not whole in the "
                             f"context")
    return context, q, (gold.headword,), at


def make(task: str, tokenizer, context_tokens: int, seed: int = 0, *, depth: float | None = None,
         text_paths: Sequence[str] | None = None) -> tuple[list[int], list[int], tuple[str, ...]]:
    """(context ids, question ids, answers) of one trial of `task`, from `seed` alone.

    `context` (chat opening, instruction, haystack: what a method compresses) has between
    `context_tokens - TOLERANCE[task]` and `context_tokens` tokens; `question` (question,
    assistant prompt, answer prefix) follows it token for token, so `context + question` is
    the encoded chat. `answers` is what `score` looks for.

    `depth` in [0, 1] places the needle of the first answer (NIAH: its needle; vt: the first
    assignment, the rest after it; qa: the answering document) at that fraction of the
    haystack; None draws it as RULER does. cwe, fwe and the first four tasks have no depth.
    `text_paths` replaces the prose of the essay haystacks (and of the first four tasks).
    """
    return _make(task, tokenizer, context_tokens, seed, depth, text_paths)[:3]


def _make(task, tokenizer, length, seed, depth, text_paths):
    if task not in TASKS:
        raise ValueError(f"task={task!r}: unknown; tasks: {', '.join(TASKS)}")
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < MIN_LENGTH:
        raise ValueError(f"context_tokens={length!r}: must be an integer >= {MIN_LENGTH}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r}: must be an integer >= 0")
    if depth is not None:
        if task in LEGACY_TASKS and task != "niah_multivalue" or task in ("cwe", "fwe"):
            raise ValueError(f"depth={depth!r}: task {task!r} has no needle depth; depth applies "
                             f"to {', '.join(t for t in RULER_TASKS if t not in ('cwe', 'fwe'))}")
        if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1:
            raise ValueError(f"depth={depth!r}: must be a number in [0, 1] (or None: random)")
    paths = None if text_paths is None else tuple(str(p) for p in text_paths)
    rng = np.random.default_rng(int(seed))
    length = int(length)
    if task in NIAH_SPECS:
        return _niah_ruler(task, tokenizer, length, rng, depth, paths)
    if task == "vt":
        return _vt_ruler(tokenizer, length, rng, depth)
    if task == "cwe":
        return _cwe_ruler(tokenizer, length, rng)
    if task == "fwe":
        return _fwe_ruler(tokenizer, length, rng)
    if task == "qa":
        return _qa_ruler(tokenizer, length, rng, depth)
    if task == "niah_multivalue" and depth is not None:
        return (*_niah(tokenizer, length, rng, 1, 4, True, paths, depth), float(depth))
    (trial,) = make_task_trials(tokenizer, task, length, 1, seed=int(seed), text_paths=paths)
    return trial.context, trial.question, trial.answers, None
