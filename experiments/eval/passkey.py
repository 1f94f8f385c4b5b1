"""Passkey retrieval on real prose: the prompts, the answer parser and the scorer.

A trial hides the needle sentence "The pass key is 12345. Remember it. 12345 is
the pass key." at a chosen depth of a haystack of real public-domain prose
(`experiments/data/devils_dictionary.txt` then `kjv_genesis.txt`, whitespace
collapsed to single spaces), wraps it in the model's chat template and asks for
the key. The prompt is split in two token lists:

* `context`: chat-template opening (SmolLM2's default system turn), the user
  turn's opening, the instruction, a blank line and the haystack with the
  needle; exactly `length` tokens. This is what a cache-compression method
  would prefill and compress.
* `question`: "\\n\\nWhat is the pass key? Answer with the number only.", the
  end of the user turn, the assistant generation prompt and the
  assistant-side answer prefix "The pass key is" (about 25 tokens, the same
  for every trial).

How the split is made: the whole chat is rendered once with
`Tokenizer.apply_chat_template` (the answer prefix appended after the
generation prompt), the rendered string is cut at the character right after
the haystack, and both the full string and the part before the cut are
encoded. `question` is the full encoding minus the `context` prefix, and
`make_trials` checks that `context` is a prefix of the full encoding, so
`context + question` is token-for-token the encoding of the rendered chat.
The cut is clean because the haystack ends with sentence punctuation and the
question starts with "\\n\\n" (two separate newline tokens for SmolLM2).

How the length is hit: the haystack is whole sentences, so it starts and
ends on sentence boundaries (".", "!" or "?", not after abbreviations such as
the dictionary's "n." or "v.t."). The corpus is encoded once per tokenizer
(token offsets give each sentence's token count). From a random sentence on,
each of the next 512 sentences is tried as the start, with the longest run
of following sentences that fits as the end, until one whose estimated
context is exactly `length` tokens is confirmed by the real encoding; if none
is (never seen on the default texts), the closest span within 1 % is used.
The needle goes at the sentence boundary whose token position is closest to
`depth` times the haystack's token count, so at depth 0 it opens the
haystack and at depth 1 it closes it.

The random draws do not depend on `length`: with the same seed and depths,
trials of different lengths share keys and starting sentences.

Example::

    from models.loading import load_model
    from models.sampler import generate
    from experiments.eval.passkey import make_trials, parse_answer, score_trials

    model, tok = load_model("smollm2")
    trials = make_trials(tok, length=1024, depths=[0.1, 0.5], trials_per_depth=2)
    out = generate(model, [t.context + t.question for t in trials], max_new_tokens=8)
    texts = [tok.decode(row[:n]) for row, n in zip(out.tokens, out.num_tokens)]
    hits = score_trials(trials, texts)          # list[bool], one per trial
"""

from __future__ import annotations

import functools
import re
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

__all__ = ["PasskeyTrial", "make_trials", "parse_answer", "score_trials", "load_corpus",
           "DEFAULT_TEXTS", "INSTRUCTION", "QUESTION", "ANSWER_PREFIX", "NEEDLE"]

DATA_DIR = Path(__file__).parents[1] / "data"
DEFAULT_TEXTS = (DATA_DIR / "devils_dictionary.txt", DATA_DIR / "kjv_genesis.txt")

INSTRUCTION = ("There is important information hidden inside a lot of irrelevant text. "
               "Find it and memorize it. I will quiz you about it.")
QUESTION = "What is the pass key? Answer with the number only."
ANSWER_PREFIX = "The pass key is"
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."

LENGTH_TOLERANCE = 0.01  # accepted |context tokens - length| / length when exact fails
_START_CANDIDATES = 512  # sentence starts tried, from the random one on
_VERIFY = 8  # estimated-exact spans checked by encoding, then as many closest ones


@dataclass(frozen=True)
class PasskeyTrial:
    context: list[int]  # int[~length]: chat opening + instruction + haystack with needle
    question: list[int]  # int[~25]: question + end of user turn + assistant prompt + prefix
    answer: str  # the key, 5 digits, e.g. "40712"
    depth: float  # requested needle depth in [0, 1] (fraction of the haystack)
    length: int  # requested context tokens

    @property
    def prompt(self) -> list[int]:
        """context + question: the ids to generate from."""
        return self.context + self.question


# ----------------------------------------------------------------------------- corpus

class Corpus(NamedTuple):
    text: str  # all texts joined, whitespace collapsed to single spaces
    starts: np.ndarray  # int64[S] sorted char offsets where a sentence starts (0 included)


# Words that end with a period without ending a sentence (The Devil's Dictionary's
# part-of-speech labels, e.g. "ABASEMENT, n.  A decent ...").
_ABBREVIATIONS = {"n", "v", "adj", "adv", "pro", "pron", "pp", "pl", "x", "mos", "fr",
                  "prep", "conj", "interj", "st", "mr", "mrs", "dr", "etc", "cf", "vs"}
_BOUNDARY = re.compile(r"""(\S*[.!?]["')\]]*) (?=["'(\[]?[A-Z0-9])""")


def _ends_sentence(word: str) -> bool:
    core = word.rstrip("\"')]")[:-1]  # without closing quotes and the final . ! ?
    core = core.lstrip("\"'([")
    if "." in core:  # v.t., n.pl., G.J.
        return False
    if len(core) == 1 and core.isupper():  # an initial
        return False
    return core.lower() not in _ABBREVIATIONS


@functools.lru_cache(maxsize=4)
def load_corpus(text_paths: tuple[str, ...] | None = None) -> Corpus:
    """The haystack prose: the texts joined, whitespace normalised, sentence starts found."""
    paths = DEFAULT_TEXTS if text_paths is None else text_paths
    text = " ".join(" ".join(Path(p).read_text(encoding="utf-8").split()) for p in paths)
    starts = [0] + [m.end() for m in _BOUNDARY.finditer(text) if _ends_sentence(m.group(1))]
    return Corpus(text, np.asarray(starts, np.int64))


# ----------------------------------------------------------------------------- prompts

def render(tokenizer, haystack: str, instruction: str = INSTRUCTION, question: str = QUESTION,
           answer_prefix: str = ANSWER_PREFIX) -> tuple[list[int], list[int]]:
    """haystack text -> (context ids, question ids); see the module docstring.

    The chat's user turn is `instruction`, a blank line, `haystack`, a blank
    line and `question`; `answer_prefix` opens the assistant's turn. This is
    `models.pipeline.chat_prompt` with `instruction + haystack` as the context
    (the same rendering `ask` uses); trailing whitespace of the haystack is
    dropped, as there.
    """
    from models.pipeline import chat_prompt  # here: importing this module stays jax-free

    return chat_prompt(tokenizer, question, f"{instruction}\n\n{haystack}",
                       answer_prefix=answer_prefix)


class _Tokenized(NamedTuple):
    text: str  # the corpus text twice, joined by a space (haystacks wrap around)
    starts: np.ndarray  # int64[2S] sentence starts in `text`
    tok_at: np.ndarray  # int64[2S] tokens before each sentence start (its " Word" token)


# Encoding the corpus takes about a second, so it is kept per tokenizer.
_TOKENIZED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _tokenized(tokenizer, corpus: Corpus) -> _Tokenized:
    per_tokenizer = _TOKENIZED.setdefault(tokenizer, {})
    key = corpus.text
    if key not in per_tokenizer:
        offsets = tokenizer.backend.encode(corpus.text, add_special_tokens=False).offsets
        tok_starts = np.asarray([a for a, _ in offsets], np.int64)  # [T] char offsets
        shift = len(corpus.text) + 1
        tok_starts = np.concatenate([tok_starts, tok_starts + shift])
        starts = np.concatenate([corpus.starts, corpus.starts + shift])
        tok_at = np.searchsorted(tok_starts, np.maximum(starts - 1, 0))
        per_tokenizer[key] = _Tokenized(corpus.text + " " + corpus.text, starts, tok_at)
    return per_tokenizer[key]


def _haystack(text: str, span: np.ndarray, k: int, needle: str) -> str:
    """Sentences text[span[0]:span[-1] - 1] with the needle placed before sentence k."""
    before = text[span[0]:span[k] - 1] if k > 0 else ""
    after = text[span[k]:span[-1] - 1] if k < len(span) - 1 else ""
    return " ".join(p for p in (before, needle, after) if p)


def _make_one(tokenizer, tokenized: _Tokenized, length: int, depth: float, key: int,
              first: int) -> PasskeyTrial:
    text, starts, tok_at = tokenized
    needle = NEEDLE.format(key=key)
    overhead = len(render(tokenizer, needle)[0]) - len(tokenizer.encode(needle))
    # context tokens = overhead + needle + prose; the prose's first word has no leading
    # space unless the needle comes first (k == 0)
    blank_line = len(tokenizer.encode("\n\nThe")) - len(tokenizer.encode("The"))
    needle_cost = {True: len(tokenizer.encode(needle)),
                   False: len(tokenizer.encode(" " + needle))}

    def first_word_change(i):
        # tokens of the first word after the blank line minus those of " word" that
        # tok_at counts ("\n\n" + digit is one token fewer: the newlines merge)
        end = text.find(" ", starts[i])
        word = text[starts[i]:end if end >= 0 else len(text)]
        after_blank = len(tokenizer.encode("\n\n" + word)) - blank_line
        return after_blank - len(tokenizer.encode(" " + word))

    def needle_index(i, j):
        rel = tok_at[i:j + 1] - tok_at[i]  # token position of each sentence boundary
        return int(np.argmin(np.abs(rel - depth * rel[-1])))

    def estimate(i):
        """(end j, needle index k, estimated context tokens) of the longest fitting span."""
        for needle_first in (False, True):
            change = 0 if needle_first else first_word_change(i)
            room = length - overhead - needle_cost[needle_first] - change
            j = int(np.searchsorted(tok_at, tok_at[i] + room, side="right")) - 1
            if j <= i:
                return j, 0, None
            k = needle_index(i, j)
            if (k == 0) == needle_first:
                break
        return j, k, overhead + needle_cost[k == 0] + change + int(tok_at[j] - tok_at[i])

    def build(i, j, k):
        context, question = render(tokenizer, _haystack(text, starts[i:j + 1], k, needle))
        return abs(len(context) - length), context, question

    best, candidates = None, []
    for i in range(first, min(first + _START_CANDIDATES, len(starts) - 1)):
        j, k, est = estimate(i)
        if est is None:
            continue
        candidates.append((length - est, i, j, k))
        if est == length:  # estimated exact: check with the real encoding
            best = min(best or (length + 1,), build(i, j, k), key=lambda r: r[0])
            if best[0] == 0:
                break
            if len(candidates) > 4 * _VERIFY and best[0] <= LENGTH_TOLERANCE * length:
                break
    if best is None or best[0] > 0:
        for _, i, j, k in sorted(candidates)[:_VERIFY]:
            best = min(best or (length + 1,), build(i, j, k), key=lambda r: r[0])
    if best is None or best[0] > LENGTH_TOLERANCE * length:
        raise ValueError(f"could not build a {length}-token context from whole sentences "
                         f"(closest: {None if best is None else best[0]} tokens off)")
    _, context, question = best
    return PasskeyTrial(context, question, str(key), float(depth), int(length))


def make_trials(tokenizer, length: int, depths: Sequence[float], trials_per_depth: int,
                seed: int = 0, text_paths: Sequence[str | Path] | None = None
                ) -> list[PasskeyTrial]:
    """`len(depths) * trials_per_depth` trials, ordered by depth then trial.

    Each trial draws a key in [10000, 99999] and a random starting sentence of
    the corpus (the corpus wraps around at its end) from
    `np.random.default_rng(seed)`; the same arguments give the same trials.
    `len(trial.context) == length` (within 1 % in the worst case, see the
    module docstring). `text_paths` replaces the default prose files.
    """
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must lie in [0, 1], got {list(depths)}")
    corpus = load_corpus(None if text_paths is None else tuple(str(p) for p in text_paths))
    tokenized = _tokenized(tokenizer, corpus)
    if tokenized.tok_at[len(corpus.starts)] <= length:  # tokens in one copy of the corpus
        raise ValueError(f"the corpus is too short for {length}-token contexts")
    rng = np.random.default_rng(seed)
    trials = []
    for depth in depths:
        for _ in range(trials_per_depth):
            key = int(rng.integers(10000, 100000))
            first = int(rng.integers(len(corpus.starts)))
            trials.append(_make_one(tokenizer, tokenized, length, depth, key, first))
    return trials


# ----------------------------------------------------------------------------- scoring

_FIVE_DIGITS = re.compile(r"(?<!\d)\d{5}(?!\d)")


def parse_answer(text: str) -> str | None:
    """The first run of exactly 5 digits in decoded text, else None.

    Decode generated ids first (SmolLM2 emits one token per digit):
    `parse_answer(tok.decode(ids))`. "The pass key is 12345." -> "12345";
    "1234" -> None; "123456" -> None (a 6-digit run is not a 5-digit key).
    """
    m = _FIVE_DIGITS.search(text)
    return m.group(0) if m else None


def score_trials(trials: Sequence[PasskeyTrial], generated_texts: Sequence[str]) -> list[bool]:
    """[parse_answer(text) == trial.answer] for each pair; lengths must match."""
    if len(trials) != len(generated_texts):
        raise ValueError(f"{len(trials)} trials but {len(generated_texts)} texts")
    return [parse_answer(t) == trial.answer for trial, t in zip(trials, generated_texts)]
