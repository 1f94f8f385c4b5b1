"""Fixed-length-model perplexity over sliding windows, batched.

Windows of `context` tokens start at 0, stride, 2*stride, ... until one
reaches the end of the text. In each window only the tokens that no earlier
window scored are scored, each conditioned on the tokens before it in its
window; the first token of the text is never scored. With stride == context
this is plain chunked perplexity; with a smaller stride every scored token
sees at least `context - stride` tokens of context.

With `prefix=P` each window is split: its first P tokens are prefilled and
compressed by a cache transform (the method under test), the rest are fed on
top of the compressed cache and only they are scored (continuation
perplexity; with `full` the ordinary perplexity of window positions >= P).

Example:
    >>> result = perplexity(model, ids, context=512, stride=256)
    >>> result.ppl, result.tokens_scored
    >>> perplexity(model, ids, context=1024, prefix=768, transform=snapkv(ratio=0.5))
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

from kvjax.core.cache import EMPTY
from kvjax.core.transforms import CacheTransform, full
from models.llama import Llama
from models.loading import progress_enabled
from models.scoring import score_continuations, token_logprobs


class Window(NamedTuple):
    start: int  # first token of the window
    end: int  # one past its last token
    first_scored: int  # first token this window scores (earlier ones were scored before)


class Perplexity(NamedTuple):
    ppl: float
    nll: float  # summed negative log-likelihood (nats)
    tokens_scored: int
    cache_bytes: float = 0.0  # the (compressed) prefix's cache per window, `kvjax.nbytes`, mean
    full_bf16_bytes: float = 0.0  # the same prefix as an uncompressed bfloat16 cache, per window
    cache_bf16_bytes: float = 0.0  # the compressed prefix's float leaves at 2 bytes, per window


def full_bf16_bytes(model: Llama, tokens: int) -> int:
    """`kvjax.nbytes` of one sequence's uncompressed bfloat16 cache holding `tokens` tokens
    (keys, values, positions, cursors; computed from shapes, nothing allocated).

    Example:
        >>> from flax import nnx
        >>> from models.llama import LlamaConfig
        >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
        >>> c = model.config
        >>> full_bf16_bytes(model, 10) == c.num_layers * (10 * c.num_kv_heads * (4 * c.head_dim + 4) + 4)
        True
    """
    import jax
    import jax.numpy as jnp

    import kvjax
    shapes = jax.eval_shape(lambda: kvjax.init_model_cache(model.config.cache_spec, 1, tokens,
                                                           jnp.bfloat16))
    return kvjax.nbytes(shapes)


def sliding_windows(num_tokens: int, context: int, stride: int | None = None) -> list[Window]:
    """The windows `perplexity` scores (see module docstring)."""
    stride = context if stride is None else stride
    if context < 2 or not 1 <= stride <= context:
        raise ValueError(f"need context >= 2 and 1 <= stride <= context, got {context}, {stride}")
    windows, scored_until = [], 1
    for start in range(0, max(num_tokens - 1, 1), stride):
        end = min(start + context, num_tokens)
        first = max(scored_until, start + 1)
        if first < end:
            windows.append(Window(start, end, first))
        scored_until = end
        if end == num_tokens:
            break
    return windows


def window_ids(tokenizer, path: Path, length: int, count: int) -> list[list[int]]:
    """The first `count` whole, non-overlapping windows of `length` tokens of a text file.

    Raises if the text has fewer (so a sweep never scores fewer windows than it says).
    """
    ids = tokenizer.encode(Path(path).read_text(encoding="utf-8"))
    wins = [w for w in sliding_windows(len(ids), length) if w.end - w.start == length][:count]
    if len(wins) < count:
        raise ValueError(f"{path} has {len(wins)} whole windows of {length} tokens, "
                         f"{count} were asked for")
    return [ids[w.start:w.end] for w in wins]


def perplexity(model: Llama, ids: Sequence[int], context: int, stride: int | None = None,
               *, batch_size: int = 8, chunk: int = 256, prefix: int = 0,
               transform: CacheTransform | None = None,
               progress: bool | None = None, place_cache=None) -> Perplexity:
    """Perplexity of `ids` under `model` with sliding windows; windows run batched.

    A progress bar over the windows goes to stderr when `progress` (default:
    `models.loading.progress_enabled`, a terminal or $KVJAX_PROGRESS=1).
    `place_cache` puts each batch's empty cache on devices (`kvjax ppl --mesh`:
    `models.sharding.cache_placer(mesh)`, with the weights `shard_model`'s and the
    transform `on_mesh`'s), as `models.sampler.generate`'s does.
    """
    ids = np.asarray(ids, np.int32)
    if ids.ndim != 1 or len(ids) < 2:
        raise ValueError(f"need a 1-D sequence of at least 2 token ids, got shape {ids.shape}")
    limit = model.config.max_position
    if context > limit:
        raise ValueError(f"context {context} must be <= the model's {limit} positions")
    if batch_size < 1 or chunk < 1:
        raise ValueError(f"batch_size and chunk must be >= 1, got {batch_size}, {chunk}")
    transform = transform or full()
    show = progress_enabled(progress)
    if prefix or transform is not full():
        return _continuation_perplexity(model, ids, context, stride, batch_size, chunk, prefix,
                                        transform, show, place_cache)
    windows = sliding_windows(len(ids), context, stride)
    width = max(w.end - w.start for w in windows)
    nll, scored = 0.0, 0
    for i in _batches(len(windows), batch_size, show):
        group = windows[i:i + batch_size]
        tokens = np.zeros((len(group), width), np.int32)
        positions = np.full((len(group), width), EMPTY, np.int32)
        targets = np.zeros((len(group), width), np.int32)
        score = np.zeros((len(group), width), bool)
        for row, w in enumerate(group):
            n, off = w.end - w.start, width - (w.end - w.start)  # left-pad short windows
            tokens[row, off:] = ids[w.start:w.end]
            positions[row, off:] = np.arange(n)
            targets[row, off:-1] = ids[w.start + 1:w.end]
            # the logit at window offset j predicts token start + j + 1
            score[row, off + (w.first_scored - w.start) - 1: width - 1] = True
        lp = np.asarray(token_logprobs(model, tokens, positions, targets, chunk=chunk,
                                       place_cache=place_cache), np.float64)
        nll -= float(lp[score].sum())
        scored += int(score.sum())
    cache_bytes = _plain_cache_bytes(model, windows)
    return Perplexity(math.exp(nll / scored), nll, scored, cache_bytes,
                      float(np.mean([full_bf16_bytes(model, w.end - w.start) for w in windows])))


def _padded_width(continuations, chunk: int) -> int:
    """Columns `score_continuations` feeds: the longest continuation padded to its chunk."""
    chunk = min(chunk, max(len(c) for c in continuations))
    return -(-max(len(c) for c in continuations) // chunk) * chunk


def _plain_cache_bytes(model: Llama, windows: list[Window]) -> float:
    """Mean bytes per window of the float32 cache holding a whole window (no compression)."""
    import jax
    import jax.numpy as jnp

    import kvjax
    spec = model.config.cache_spec
    each = [kvjax.nbytes(jax.eval_shape(lambda n=w.end - w.start: kvjax.init_model_cache(
        spec, 1, n, jnp.float32))) for w in windows]
    return float(np.mean(each))


def _batches(count: int, batch_size: int, show: bool):
    """Batch starts over `count` windows, with a bar on stderr (one tick per window)."""
    import sys

    from tqdm import tqdm
    with tqdm(total=count, desc="ppl windows", unit="window", disable=not show,
              file=sys.stderr) as bar:
        for i in range(0, count, batch_size):
            yield i
            bar.update(min(batch_size, count - i))


def _continuation_perplexity(model, ids, context, stride, batch_size, chunk, prefix,
                             transform, show: bool = False, place_cache=None) -> Perplexity:
    """Score window tokens after the first `prefix`, on a cache compressed by `transform`."""
    if not 1 <= prefix < context:
        raise ValueError(f"a compressing method needs a prefix P with 1 <= P < context "
                         f"({context}); got {prefix}")
    windows = [w for w in sliding_windows(len(ids), context, stride) if w.end - w.start > prefix]
    if not windows:
        raise ValueError(f"no window is longer than the prefix {prefix} tokens")
    import jax.numpy as jnp

    import kvjax
    from models.sampler import prefill_and_compress

    nll, scored, kept_bytes, kept_bf16 = 0.0, 0, 0, 0
    for i in _batches(len(windows), batch_size, show):
        group = windows[i:i + batch_size]
        prefixes = [ids[w.start:w.start + prefix].tolist() for w in group]
        conts = [ids[w.start + prefix:w.end].tolist() for w in group]
        # as continuation_logprobs, keeping the compressed prefix to measure its bytes
        pre = prefill_and_compress(model, prefixes, transform=transform, chunk=chunk,
                                   room=_padded_width(conts, chunk),
                                   place_cache=place_cache)
        kept = kvjax.shrink(pre.cache, 0)  # the prefix alone, no room
        kept_bytes += kvjax.nbytes(kept)
        kept_bf16 += kvjax.nbytes(kept, float_dtype=jnp.bfloat16)  # as a bf16 run stores it
        lps = score_continuations(model, pre, conts, chunk=chunk)
        for w, lp in zip(group, lps):
            first = max(w.first_scored, w.start + prefix) - (w.start + prefix)
            nll -= float(np.sum(lp[first:], dtype=np.float64))
            scored += len(lp) - first
    return Perplexity(math.exp(nll / scored), nll, scored, kept_bytes / len(windows),
                      float(full_bf16_bytes(model, prefix)), kept_bf16 / len(windows))
