"""Ask a model questions about a context, with a cache method: the notebook-first API.

`ask` does what kvpress's pipeline (`pipe(context, question=..., press=...)`)
does, on a kvjax method spec: the context is prefilled and compressed first
(query-agnostic), then the question (and an optional answer prefix opening
the reply) is appended and the answer decoded, all jitted. It returns an
`Answer` — text, token ids, the compressed cache and its bytes — that prints
as one line. `ask_batch` does the same for many questions in one batch;
`ask(..., questions=[q1, q2, q3])` compresses one context once and answers every
question from copies of that compressed cache (kvpress's pipeline with a list of questions).

Example:
    >>> from models.loading import load_model
    >>> model, tok = load_model("smollm2")
    >>> answer = ask(model, tok, "What is the pass key?", method="streaming_llm:sinks=4,window=24",
    ...              context="Remember this. The pass key is 71432. Keep it secret.",
    ...              answer_prefix="The pass key is", max_new_tokens=8)
    >>> "71432" in answer.text
    True
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import kvjax
import jax
import jax.numpy as jnp
import numpy as np

from kvjax import Cache, CacheTransform
from kvjax.core.cache import TokenCache
from models.llama import Llama
from models.sampler import (GREEDY, Prefilled, RunOptions, Sampling, _padded_width, decode,
                            extend, for_full_layers, generate,
                            prefill_and_compress)


@dataclasses.dataclass(frozen=True)
class Answer:
    """One generated answer and the cache it was generated from."""

    text: str  # the decoded answer (special tokens removed)
    tokens: list[int]  # the answer's ids, the end token included if one was drawn
    method: str  # the method spec (or "custom" for a bare CacheTransform)
    context_tokens: int  # tokens compressed before the question was seen (0 without context)
    question_tokens: int  # tokens after the context: question, chat turn end, answer prefix
    cache_bytes: int  # exact bytes of this sequence's cache after generation
    seconds: float  # wall time of the whole batch (prefill, compression, decode)
    cache: Cache = dataclasses.field(repr=False)  # the batch's cache after generation
    transform_state: Any = dataclasses.field(repr=False, default=None)  # e.g. a monitor's

    def __str__(self) -> str:
        return self.text


def prompt_pieces(tokenizer, question: str, context: str | None = None, *,
                  answer_prefix: str = "", chat: bool = True) -> tuple[list, int]:
    """(pieces [(text, trusted)], index of the context's piece or -1): the prompt `chat_prompt`
    encodes. Only the chat template's own text is trusted (may hold control tokens)."""
    user = [question] if context is None else [context.rstrip(), f"\n\n{question}"]
    if chat:
        pieces = tokenizer.chat_pieces([{"role": "user", "content": user}],
                                       add_generation_prompt=True)
        pieces.append((answer_prefix, False))
    else:
        pieces = [(u, False) for u in user]
        if answer_prefix:
            pieces.append((f"\n{answer_prefix}", False))
    if context is None:
        return pieces, -1
    # the context is the first user-text piece by construction (the template's text before it
    # is trusted, and it is never empty unless the context is)
    at = next(i for i, (text, trusted) in enumerate(pieces) if not trusted)
    if pieces[at][0] not in (context.rstrip(), context.strip()):
        raise ValueError("chat_prompt: the chat template put other text before the context")
    return pieces, at


def chat_prompt(tokenizer, question: str, context: str | None = None, *,
                answer_prefix: str = "", chat: bool = True) -> tuple[list[int], list[int]]:
    """(context ids, question ids): the prompt built from ids, cut right after the context.

    The whole text is `context`, a blank line, `question` -- inside the chat
    template's user turn when `chat` -- followed by `answer_prefix`, which opens
    the assistant's reply (e.g. "The pass key is"; on a new line without `chat`). Without a
    context the first list is empty. The cut is where the context's piece ends (known by
    construction, never searched for in the text); when the two halves tokenize
    differently from the whole (a merge across the cut) each half is encoded
    on its own, so the question ids always follow the context ids exactly.
    Control ids come only from the chat template: user text that spells them
    (`<|im_start|>`) is encoded as text.
    """
    _check_text(question, "question")
    if context is not None:
        _check_text(context, "context")
    _check_text(answer_prefix, "answer_prefix")
    if context is not None and not context.strip():
        raise ValueError(f"context: must hold some text (or be None), got {context!r}")
    pieces, at = prompt_pieces(tokenizer, question, context, answer_prefix=answer_prefix,
                               chat=chat)
    if at < 0:
        return [], tokenizer.encode_pieces(pieces)
    head, ids = tokenizer.encode_pieces(pieces[:at + 1]), tokenizer.encode_pieces(pieces)
    if ids[:len(head)] == head and len(ids) > len(head):
        return head, ids[len(head):]
    return head, tokenizer.encode_pieces(pieces[at + 1:])


def _check_text(value, name: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__} {value!r:.80}")


def _check_list(value, name: str, item: str, allow_none: bool = False) -> list:
    """`value` as a list; TypeError for a str (one item per character), None or a non-list."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of {item}, got {type(value).__name__} "
                        f"{value!r:.80}" + (" (for one question use ask)"
                                            if isinstance(value, str) else ""))
    for i, v in enumerate(value):
        if not (isinstance(v, str) or (allow_none and v is None)):
            raise TypeError(f"{name}[{i}] must be a str{' or None' if allow_none else ''}, "
                            f"got {type(v).__name__} {v!r:.80}")
    return list(value)


def parsed_method(method: "str | kvjax.Method | CacheTransform", tokenizer) -> kvjax.Method:
    """`method` parsed once (a `Method` passes through, a transform becomes one named
    "custom"), a reconstruction pass's prompt (kvzip, kvgrad, restorekv) bound to
    `tokenizer`'s ids."""
    from models.reconstruction import with_tokenizer

    if isinstance(method, CacheTransform):
        method = kvjax.Method("custom", method)
    method = kvjax.Method.parse(method)
    return method.with_transform(with_tokenizer(method.transform, tokenizer))


def ask_batch(model: Llama, tokenizer, questions: Sequence[str],
              contexts: Sequence[str | None] | None = None, *,
              method: str | kvjax.Method | CacheTransform = "full", answer_prefix: str = "",
              chat: bool = True,
              max_new_tokens: int = 64, sampling: Sampling = GREEDY, seed: int = 0,
              compress_every: int = 0, impl: str = "xla",
              place_cache=None) -> list[Answer]:
    """`ask` for many questions at once (one batch; contexts may differ in length).

    Either every question has a context or none has: the contexts are
    compressed on their own first only when all are given.
    """
    questions = _check_list(questions, "questions", "str")
    contexts = ([None] * len(questions) if contexts is None
                else _check_list(contexts, "contexts", "str or None", allow_none=True))
    if len(contexts) != len(questions):
        raise ValueError(f"contexts: {len(contexts)} contexts for {len(questions)} questions")
    if not questions:
        raise ValueError("questions: need at least one question, got none")
    with_context = [c is not None for c in contexts]
    if any(with_context) and not all(with_context):
        raise ValueError("contexts: give a context for every question or for none")
    method = parsed_method(method, tokenizer)
    split = [chat_prompt(tokenizer, q, c, answer_prefix=answer_prefix, chat=chat)
             for q, c in zip(questions, contexts)]
    heads, ids = [h for h, _ in split], [i for _, i in split]
    start = time.perf_counter()
    out = generate(model, ids, contexts=heads if all(with_context) else None,
                   max_new_tokens=max_new_tokens, sampling=sampling, transform=method.transform,
                   compress_every=compress_every, seed=seed, impl=impl,
                   place_cache=place_cache)
    seconds = time.perf_counter() - start
    per_sequence = kvjax.nbytes(out.cache) // len(questions)
    return [Answer(tokenizer.decode(row[:n]), row[:n].tolist(), method.spec, len(h), len(i),
                   per_sequence, round(seconds, 3), out.cache, out.transform_state)
            for row, n, h, i in zip(out.tokens, out.num_tokens, heads, ids)]


def ask(model: Llama, tokenizer, question: str | None = None, *,
        questions: Sequence[str] | None = None, context: str | None = None,
        method: str | kvjax.Method | CacheTransform = "full", answer_prefix: str = "",
        chat: bool = True,
        max_new_tokens: int = 64, sampling: Sampling = GREEDY, seed: int = 0,
        compress_every: int = 0, impl: str = "xla", place_cache=None) -> Answer | list[Answer]:
    """Answer `question` about `context` with the cache compressed by `method`.

    `context` (optional) is prefilled and compressed before the question is
    seen; `answer_prefix` opens the reply (kvpress's `answer_prefix`);
    `method` is a spec such as "snapkv:ratio=0.5+kivi:bits=4", a parsed `kvjax.Method` or a
    `CacheTransform`. `place_cache` puts the empty cache on devices (see
    `models.sampler.generate`; `models.sharding.cache_placer(mesh)`). See
    `ask_batch` for many questions at once.

    `questions=[q1, q2, ...]` instead of `question`: the context is prefilled and compressed
    once and every question is answered from a copy of that cache (batched; see
    `ask_many`); returns one `Answer` per question, the same tokens as one call per question.
    """
    if (question is None) == (questions is None):
        raise TypeError("ask: give either question (one str) or questions (a list of str), "
                        f"got question={question!r:.40} and questions={questions!r:.40}")
    common = dict(method=method, answer_prefix=answer_prefix, chat=chat,
                  max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                  compress_every=compress_every, impl=impl, place_cache=place_cache)
    if questions is not None:
        return ask_many(model, tokenizer, questions, context, **common)
    _check_text(question, "question")
    if context is not None:
        _check_text(context, "context")
    return ask_batch(model, tokenizer, [question], None if context is None else [context],
                     **common)[0]


def ask_many(model: Llama, tokenizer, questions: Sequence[str], context: str | None, *,
             method: str | kvjax.Method | CacheTransform = "full", answer_prefix: str = "",
             max_new_tokens: int = 64, **options) -> list[Answer]:
    """Answers to `questions` about one `context` compressed once (kvpress's pipeline).

    The context is prefilled and compressed once; the compressed cache is copied once per
    question (tiled into one batch when every layer is a dense `TokenCache` and the transform
    keeps no state, else one copy per question, run one after the other), each question is
    appended and its answer decoded. The tokens equal `ask`'s for each question alone.
    `options`: chat, sampling, seed, compress_every, impl, place_cache (as `ask`).

    Example:
        >>> from models.loading import load_model
        >>> model, tok = load_model("smollm2")
        >>> a, b = ask_many(model, tok, ["What is the pass key?", "What is kept secret?"],
        ...                 "Remember this. The pass key is 71432. Keep it secret.",
        ...                 answer_prefix="The answer is", max_new_tokens=8)
        >>> "71432" in a.text
        True
    """
    questions = _check_list(questions, "questions", "str")
    if not questions:
        raise ValueError("questions: need at least one question, got none")
    if context is None:  # nothing to share: one batch of questions
        return ask_batch(model, tokenizer, questions, None, method=method,
                         answer_prefix=answer_prefix, max_new_tokens=max_new_tokens, **options)
    _check_text(context, "context")
    chat = options.pop("chat", True)
    method = parsed_method(method, tokenizer)
    split = [chat_prompt(tokenizer, q, context, answer_prefix=answer_prefix, chat=chat)
             for q in questions]
    head, ids = split[0][0], [i for _, i in split]
    if any(h != head for h, _ in split):  # the cut is before the question: never expected
        raise ValueError("context: tokenized differently before different questions")
    run = RunOptions(**options)
    if len(head) + max(map(len, ids)) + max_new_tokens > model.config.max_position:
        raise ValueError(f"prompt plus new tokens exceed the model's context "
                         f"{model.config.max_position} tokens")
    start = time.perf_counter()
    shared = compress_context(model, head, ids, method.transform, max_new_tokens, run)
    outs = _answer_from(model, shared, ids, method.transform, max_new_tokens, run)
    seconds = round(time.perf_counter() - start, 3)
    answers = []
    for q, (out, row) in enumerate(outs):
        per_sequence = kvjax.nbytes(out.cache) // len(out.tokens)
        n = out.num_tokens[row]
        answers.append(Answer(tokenizer.decode(out.tokens[row, :n]),
                              out.tokens[row, :n].tolist(), method.spec, len(head),
                              len(ids[q]), per_sequence, seconds, out.cache,
                              out.transform_state))
    return answers


def compress_context(model: Llama, context_ids: list[int], question_ids: list[list[int]],
                     transform: CacheTransform, max_new_tokens: int,
                     run: RunOptions) -> Prefilled:
    """One sequence (batch 1): `context_ids` prefilled and compressed by `transform`, with room
    for the longest of `question_ids` (padded) and `max_new_tokens` (as `generate` leaves)."""
    suffix_room = _padded_width(question_ids, run.chunk)
    return prefill_and_compress(model, [context_ids], transform=transform,
                                room=suffix_room + max_new_tokens,
                                max_write=max(suffix_room, 1), **run.only(RunOptions.COMPRESS))


def _answer_from(model: Llama, shared: Prefilled, question_ids: list[list[int]],
                 transform: CacheTransform, max_new_tokens: int, run: RunOptions) -> list:
    """[(Generation, row)] per question: each continues a copy of the one-sequence `shared`."""
    batch = None
    if not run.compress_every:  # stats are per sequence; only compress_every would read them
        batch = tile_prefilled(shared, len(question_ids), for_full_layers(model, transform))
    if batch is not None:
        out = decode(model, extend(model, batch, question_ids, chunk=run.chunk, impl=run.impl),
                     max_new_tokens=max_new_tokens, transform=transform,
                     **run.only(RunOptions.DECODE))
        return [(out, q) for q in range(len(question_ids))]
    outs = []
    for ids in question_ids:
        copy = shared._replace(cache=jax.tree_util.tree_map(jnp.copy, shared.cache))
        pre = extend(model, copy, [ids], transform=transform, chunk=run.chunk, impl=run.impl)
        outs.append((decode(model, pre, max_new_tokens=max_new_tokens, transform=transform,
                            **run.only(RunOptions.DECODE)), 0))
    return outs


def _is_dense(layer) -> bool:
    """A `TokenCache` of plain arrays: every leaf [B*KVH | B, ...] with the batch outermost
    (the write cursor `length` [] shared)."""
    return (type(layer) is TokenCache and isinstance(layer.k, jax.Array)
            and isinstance(layer.v, jax.Array))


def _tile_axis(one: jax.ShapeDtypeStruct, many: jax.ShapeDtypeStruct, copies: int):
    """The axis a state leaf carries the batch on (from its shapes at batch 1 and `copies`),
    None for a leaf shared by the batch, -1 when the shapes say neither."""
    differ = [i for i, (a, b) in enumerate(zip(one.shape, many.shape)) if a != b]
    if len(one.shape) != len(many.shape) or len(differ) > 1:
        return -1
    if not differ:
        return None
    return differ[0] if (one.shape[differ[0]], many.shape[differ[0]]) == (1, copies) else -1


def tile_prefilled(pre: Prefilled, copies: int,
                   transform: CacheTransform | None = None) -> Prefilled | None:
    """A one-sequence `pre` as a batch of `copies` identical sequences (statistics dropped),
    or None when it cannot be tiled: a layer other than a dense `TokenCache`, or a transform
    state whose batch axis `transform.init`'s shapes at batch 1 and `copies` do not tell.

    Example:
        >>> from flax import nnx
        >>> from models.llama import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
        >>> pre = prefill_and_compress(model, [list(range(3, 19))], room=4)
        >>> three = tile_prefilled(pre, 3)
        >>> three.cache[0].k.shape, three.next_pos.tolist()      # [3*KVH, C, D]
        ((6, 20, 16), [16, 16, 16])
    """
    if len(pre.next_pos) != 1 or not all(map(_is_dense, pre.cache)):
        return None
    tile = lambda x, axis=0: jnp.concatenate([x] * copies, axis=axis) if x.ndim else x
    cache = jax.tree_util.tree_map(tile, pre.cache)
    state = pre.transform_state
    if jax.tree_util.tree_leaves(state):
        one = jax.eval_shape(transform.init, pre.cache)
        many = jax.eval_shape(transform.init, cache)
        if (jax.tree_util.tree_structure(one) != jax.tree_util.tree_structure(state)
                or jax.tree_util.tree_structure(many) != jax.tree_util.tree_structure(state)):
            return None
        axes = jax.tree_util.tree_map(lambda a, b: _tile_axis(a, b, copies), one, many)
        flat_axes = jax.tree_util.tree_leaves(axes, is_leaf=lambda x: x is None)
        if -1 in flat_axes:
            return None
        leaves, tree = jax.tree_util.tree_flatten(state)
        state = tree.unflatten([x if axis is None else tile(x, axis)
                                for x, axis in zip(leaves, flat_axes)])
    return Prefilled(tile(pre.logits), cache, None, state, np.repeat(pre.next_pos, copies))
