"""Train LESS / Hedgehog-style feature maps on a model's own queries and keys, with optax.

The learned maps (`kvjax.policies.feature_maps.hedgehog`: per layer and KV head, a
query map `phi` and a key map `psi`, `x -> [exp(xW + b), exp(-(xW + b))]`) are
fitted so that the hybrid attention of `kvjax.policies.recurrent.hybrid_attend` —
softmax over kept tokens plus the state's estimate of the evicted ones —
matches full softmax attention:

    loss(layer) = sum (hybrid - full)^2 / sum (kept_only - full)^2

over the last `queries` tokens of windows of real prose, whose prefix is
compressed as an eviction run compresses it: the sinks, a 16-token
observation window and the `keep` fraction of prefix tokens that window
attends to most (SnapKV-style) stay exact, the rest is folded; the
continuation tokens stay exact. So the loss is the attention-output error
relative to eviction alone: below 1 means the folded state recovers part of
what eviction lost; 0 is full attention. (A first version trained on random
eviction patterns over 128-token windows: it reached 0.62 on held-out
windows of that kind but blew up perplexity at 1k tokens, where evicted
tokens are far and low-attention.)
Every layer is trained at once (independent parameters, one summed loss),
on queries, keys and values captured from the frozen model.

Example:
    >>> import tempfile
    >>> from kvjax import parse_method, save_maps
    >>> from models.llama import Llama, LlamaConfig
    >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))   # real use: load_model("smollm2")
    >>> windows = [list(range(3, 67))] * 2   # real use: token_windows(tok, texts, 1024, n)
    >>> result = train_feature_maps(model, windows, steps=2, queries=16, progress=False)
    >>> len(result.maps), result.maps[0].kind, len(result.losses)   # one map per layer
    (2, 'hedgehog', 2)
    >>> where = str(save_maps(tempfile.mkdtemp(), result.maps))
    >>> t = parse_method(f"snapkv:ratio=0.75+fold:map={where}")
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from kvjax.policies.feature_maps import (FeatureMap, elu_map, hedgehog, hedgehog_features,
                                         random_features, save_maps, with_params)
from kvjax.core.stats import StatsSpec
from models.llama import Llama

SINKS, WINDOW = 4, 16  # an eviction policy keeps the first tokens and its observation window


class Activations(NamedTuple):
    """What attention sees in every layer, for N windows of T tokens.

    The queries are those of the last `WINDOW` prefix tokens (a SnapKV-style
    observation window that picks the kept tokens) followed by the `Q`
    continuation queries the loss is measured on.
    """

    q: np.ndarray  # [L, N, WINDOW + Q, H, D] float32 queries after RoPE
    k: np.ndarray  # [L, N, KVH, T, D] float32 keys after RoPE
    v: np.ndarray  # [L, N, KVH, T, D] float32 values


@functools.partial(jax.jit, static_argnames=("graphdef", "keep_queries"))
def _capture(graphdef, state, tokens, keep_queries):
    model = nnx.merge(graphdef, state)
    n, t = tokens.shape
    cfg = model.config
    spec = StatsSpec(window=keep_queries)
    cache = kvjax.init_model_cache(cfg.cache_spec, n, t)
    stats = model.init_stats(spec, cache)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (n, t))
    _, cache, stats = model.forward(tokens, pos, cache, stats, spec)
    q = jnp.stack([s.queries for s in stats])  # [L, N, WINDOW + Q, H, D]
    fold = lambda x: x.reshape(n, cfg.num_kv_heads, t, cfg.head_dim)
    return q, jnp.stack([fold(c.k) for c in cache]), jnp.stack([fold(c.v) for c in cache])


def collect_activations(model: Llama, windows: Sequence[Sequence[int]], queries: int,
                        batch: int = 2) -> Activations:
    """Run the frozen model over token windows (equal lengths); keep q (the last
    `WINDOW + queries` positions), k and v of every layer."""
    if not windows or len({len(w) for w in windows}) != 1:
        raise ValueError("collect_activations: need one or more token windows of equal length")
    t = len(windows[0])
    if queries < 1 or queries + WINDOW + SINKS >= t:
        raise ValueError(f"collect_activations: queries={queries} must be in [1, "
                         f"{t - WINDOW - SINKS}) for windows of {t} tokens")
    graphdef, state = nnx.split(model)
    parts = [_capture(graphdef, state, jnp.asarray(windows[i:i + batch], jnp.int32),
                      WINDOW + queries) for i in range(0, len(windows), batch)]
    return Activations(*(np.concatenate([np.asarray(p[j]) for p in parts], axis=1)
                         for j in range(3)))


def _group(q: jax.Array, kvh: int) -> jax.Array:
    """[N, T, H, D] -> [N, KVH, G*T, D] (query head h reads KV head h // G)."""
    n, t, h, d = q.shape
    return q.reshape(n, t, kvh, h // kvh, d).transpose(0, 2, 3, 1, 4).reshape(n, kvh, -1, d)


def _causal(q_pos: jax.Array, t: int, g: int) -> jax.Array:
    """[G*Q, T] bool: key j is not after the query (rows in the grouped (g, q) order)."""
    return jnp.tile(jnp.arange(t)[None, :] <= q_pos[:, None], (g, 1))


def snap_keep(q_obs: jax.Array, k: jax.Array, keep: float, prefix: int) -> jax.Array:
    """[N, KVH, T] bool: what a SnapKV-style policy keeps of the prefix, plus the continuation.

    The prefix is the first `prefix` tokens, ending with the observation window
    whose queries are `q_obs` [N, WINDOW, H, D]; it keeps the sinks, the window
    and the `keep` fraction of prefix tokens with the most window attention (mean
    over the window's queries and the group's heads). Continuation tokens (after
    the prefix) are all kept, as they are when a compressed cache is extended.
    """
    n, kvh, t, d = k.shape
    w = q_obs.shape[1]
    g = q_obs.shape[2] // kvh
    q_pos = prefix - w + jnp.arange(w)
    s = jnp.einsum("nkqd,nktd->nkqt", _group(q_obs, kvh), k) * d ** -0.5
    s = jnp.where(_causal(q_pos, t, g)[None, None], s, -jnp.inf)
    score = jax.nn.softmax(s, -1).mean(2)  # [N, KVH, T]
    j = jnp.arange(t)
    score = jnp.where(j < prefix, score, -1.0)
    budget = max(1, int(keep * prefix))
    top = jax.lax.top_k(score, budget)[1]  # [N, KVH, budget]
    kept = jnp.zeros((n, kvh, t), bool).at[
        jnp.arange(n)[:, None, None], jnp.arange(kvh)[None, :, None], top].set(True)
    return kept | (j < SINKS) | (j >= prefix - w)


def hybrid_errors(fq: jax.Array, fk: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                  keep: jax.Array, g: int) -> tuple[jax.Array, jax.Array]:
    """Squared error of the hybrid and of eviction alone against full attention, summed.

    Args:
      fq: [N, KVH, G*Q, F] features of the grouped continuation queries (the last Q
        positions, rows in (g, q) order); fk: [N, KVH, T, F] key features.
      q: [N, KVH, G*Q, D] grouped queries; k, v: [N, KVH, T, D]; keep: [N, KVH, T] bool;
      g: query heads per KV head.
    """
    t, d = k.shape[2], k.shape[3]
    n_q = q.shape[2] // g
    causal = _causal(t - n_q + jnp.arange(n_q), t, g)[None, None]  # [1, 1, G*Q, T]
    kept = keep[:, :, None, :] & causal
    gone = ~keep[:, :, None, :] & causal
    s = jnp.einsum("nkqd,nktd->nkqt", q, k) * d ** -0.5
    target = jnp.einsum("nkqt,nktd->nkqd", jax.nn.softmax(jnp.where(causal, s, -jnp.inf), -1), v)
    s_kept = jnp.where(kept, s, -jnp.inf)
    only = jnp.einsum("nkqt,nktd->nkqd", jax.nn.softmax(s_kept, -1), v)
    a = jnp.einsum("nkqf,nktf->nkqt", fq, fk) * gone  # state weights of the evicted tokens
    den_state = a.sum(-1)
    m = jax.lax.stop_gradient(jnp.maximum(s_kept.max(-1), jnp.log(den_state + 1e-30)))
    p = jnp.exp(s_kept - m[..., None])
    scale = jnp.exp(-m)
    num = jnp.einsum("nkqt,nktd->nkqd", p, v) + scale[..., None] * jnp.einsum(
        "nkqt,nktd->nkqd", a, v)
    out = num / (p.sum(-1) + scale * den_state)[..., None]
    return jnp.sum((out - target) ** 2), jnp.sum((only - target) ** 2)


def _rows_features(fm_apply, x: jax.Array, kvh: int) -> jax.Array:
    """Apply a row-wise map ([R, M, D] with row r -> head r % KVH) to x [N, KVH, M, D]."""
    n, _, m, d = x.shape
    return fm_apply(x.reshape(n * kvh, m, d), kvh).reshape(n, kvh, m, -1)


def _learned(params, x, kvh, which):
    """Learned features of x [N, KVH, M, D] with params (wq, bq, wk, bk) [KVH, ...]."""
    w, b = params[which], params[which + 1]
    n = x.shape[0]
    rows = lambda a: jnp.tile(a, (n,) + (1,) * (a.ndim - 1))
    return hedgehog_features(x.reshape(n * kvh, *x.shape[2:]), rows(w), rows(b)).reshape(
        n, kvh, x.shape[2], -1)


def _split(q, k, keep):
    """Observation-window queries, grouped continuation queries, the keep mask."""
    kvh, t = k.shape[1], k.shape[2]
    n_q = q.shape[1] - WINDOW
    mask = snap_keep(q[:, :WINDOW], k, keep, t - n_q)
    return _group(q[:, WINDOW:], kvh), mask


def _layer_loss(params, q, k, v, keep: float):
    """Relative error of one layer: hybrid vs eviction alone (q [N, W+Q, H, D], k, v [N, KVH, T, D])."""
    kvh = k.shape[1]
    qg, mask = _split(q, k, keep)
    g = q.shape[2] // kvh
    err, base = hybrid_errors(_learned(params, qg, kvh, 0), _learned(params, k, kvh, 2),
                               qg, k, v, mask, g)
    return err / base


@functools.partial(jax.jit, static_argnames=("keep",))
def _loss(params, q, k, v, keep: float):
    """Mean over layers of the relative error; params, q, k, v stacked over layers."""
    layer = lambda p, q, k, v: _layer_loss(p, q, k, v, keep)
    return jnp.mean(jax.vmap(layer)(params, q, k, v))


def relative_errors(fm_per_layer: Sequence[FeatureMap], acts: Activations,
                    keep: float) -> np.ndarray:
    """[L] hybrid error / eviction-alone error per layer for fixed maps (held-out evaluation)."""
    out = []
    kvh = acts.k.shape[2]
    for layer, fm in enumerate(fm_per_layer):
        q, k, v = (jnp.asarray(x[layer]) for x in acts)
        qg, mask = _split(q, k, keep)
        err, base = hybrid_errors(_rows_features(fm.query, qg, kvh),
                                   _rows_features(fm.key, k, kvh), qg, k, v, mask,
                                   q.shape[2] // kvh)
        out.append(float(err / base))
    return np.asarray(out)


@dataclasses.dataclass
class TrainResult:
    maps: tuple[FeatureMap, ...]  # one learned map per layer
    losses: list[float]  # training loss per step (mean relative error over layers)
    heldout: dict[str, list[float]]  # map name -> per-layer relative error on held-out windows


def token_windows(tokenizer, texts: Sequence[str], length: int, count: int) -> list[list[int]]:
    """Up to `count` consecutive, non-overlapping windows of `length` tokens from `texts`."""
    ids = [i for text in texts for i in tokenizer.encode(text)]
    windows = [ids[s:s + length] for s in range(0, len(ids) - length + 1, length)][:count]
    if not windows:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {length}")
    return windows


def train_feature_maps(model: Llama, windows: Sequence[Sequence[int]],
                       heldout: Sequence[Sequence[int]] = (), *, features: int = 64,
                       steps: int = 200, lr: float = 1e-2, keep: float = 0.25,
                       queries: int = 128, batch: int = 2, seed: int = 0,
                       progress: bool = True) -> TrainResult:
    """Fit one learned map per layer on token `windows` (equal lengths) of real text.

    Each window is split as an eviction run sees it: a prefix compressed by a
    SnapKV-style choice (`keep` of its tokens plus sinks and the observation
    window) and the last `queries` tokens, whose attention outputs the loss
    compares. Each step draws `batch` windows and takes one Adam step (optax)
    on every layer's map. With `heldout` windows, the result reports the
    relative error of the learned maps, positive random features (`features`
    of them) and elu+1 on them.
    """
    import optax
    from tqdm.auto import tqdm

    for name, value, low in (("features", features, 2), ("steps", steps, 1),
                             ("batch", batch, 1), ("queries", queries, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"train_feature_maps: {name} must be an int >= {low}, got {value!r}")
    if not 0 < keep < 1:
        raise ValueError(f"train_feature_maps: keep must be in (0, 1), got {keep!r}")
    if not lr > 0:
        raise ValueError(f"train_feature_maps: lr must be positive, got {lr!r}")
    cfg = model.config
    acts = collect_activations(model, windows, queries)
    n = acts.q.shape[1]
    init = [hedgehog(cfg.num_kv_heads, cfg.head_dim, features, seed + i)
            for i in range(cfg.num_layers)]
    params = tuple(jnp.stack([jnp.asarray(m.params[j]) for m in init]) for j in range(4))
    opt = optax.adam(lr)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, q, k, v):
        loss, grads = jax.value_and_grad(_loss)(params, q, k, v, float(keep))
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    losses = []
    bar = tqdm(range(steps), desc="train-state", disable=not progress)
    for _ in bar:
        pick = np.sort(rng.choice(n, size=min(batch, n), replace=False))
        params, opt_state, loss = step(params, opt_state, *(jnp.asarray(x[:, pick])
                                                             for x in acts))
        losses.append(float(loss))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    maps = tuple(with_params(init[i], [np.asarray(p[i]) for p in params])
                 for i in range(cfg.num_layers))
    report = {}
    if heldout:
        held = collect_activations(model, heldout, queries)
        d = cfg.head_dim
        report = {"learned": maps,
                  f"prf{features}": [random_features(d, features, seed)] * cfg.num_layers,
                  "elu": [elu_map(d)] * cfg.num_layers}
        report = {name: relative_errors(fms, held, keep).tolist() for name, fms in report.items()}
    return TrainResult(maps, losses, report)


def plot_losses(losses: Sequence[float], path: str | Path, heldout: dict | None = None) -> Path:
    """The loss curve (and held-out errors per layer, if given) as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2 if heldout else 1, figsize=(11 if heldout else 6, 4))
    axes = np.atleast_1d(axes)
    axes[0].plot(losses)
    axes[0].set(xlabel="step", ylabel="hybrid error / eviction-alone error",
                title="training loss (mean over layers)")
    axes[0].axhline(1.0, color="gray", lw=0.8, ls="--")
    if heldout:
        for name, errs in heldout.items():
            axes[1].plot(errs, marker="o", ms=3, label=name)
        axes[1].axhline(1.0, color="gray", lw=0.8, ls="--", label="eviction alone")
        axes[1].set(xlabel="layer", ylabel="relative error (held-out)", yscale="log",
                    title="held-out attention-output error")
        axes[1].legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "experiments" / "data" / \
    "devils_dictionary.txt"  # shipped with kvjax; the perplexity eval reads KJV Genesis


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the first option out of its range (before the model loads)."""
    rules = [("seq_len", args.seq_len > args.queries, f"must be > --queries {args.queries}"),
             ("queries", args.queries >= 1, "must be >= 1"),
             ("windows", args.windows >= 1, "must be >= 1"),
             ("heldout", args.heldout >= 0, "must be >= 0"),
             ("features", args.features >= 2 and args.features % 2 == 0, "must be even, >= 2"),
             ("steps", args.steps >= 1, "must be >= 1"),
             ("lr", 0 < args.lr < float("inf"), "must be a positive number"),
             ("keep", 0 < args.keep < 1, "must be in (0, 1)"),
             ("batch", 1 <= args.batch <= args.windows, "must be in [1, --windows]"),
             ("seed", args.seed >= 0, "must be >= 0")]
    for name, ok, allowed in rules:
        if not ok:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)}: {allowed}")
    for path in args.data:
        if not Path(path).is_file():
            raise FileNotFoundError(f"--data {path}: not a file")


def run(args: argparse.Namespace) -> dict:
    """`kvjax train-state`: train, save the maps, the curve and a summary; returns the summary."""
    from models.loading import load_model
    check_args(args)
    model, tokenizer = load_model(args.model)
    texts = [Path(f).read_text() for f in args.data]
    windows = token_windows(tokenizer, texts, args.seq_len, args.windows + args.heldout)
    if len(windows) <= args.heldout:
        raise ValueError(f"--data has {len(windows)} windows of {args.seq_len} tokens; need "
                         f"more than --heldout {args.heldout}")
    train, held = windows[:-args.heldout or None], windows[len(windows) - args.heldout:]
    start = time.time()
    result = train_feature_maps(model, train, held if args.heldout else (),
                                features=args.features, steps=args.steps, lr=args.lr,
                                keep=args.keep, queries=args.queries, batch=args.batch,
                                seed=args.seed)
    out = Path(args.out)
    save_maps(out, result.maps)
    plot_losses(result.losses, out / "loss.png", result.heldout)
    summary = dict(args={k: v for k, v in vars(args).items() if k != "func"},
                   seconds=round(time.time() - start, 1), train_windows=len(train),
                   first_loss=result.losses[0], last_loss=result.losses[-1],
                   heldout_mean={k: float(np.mean(v)) for k, v in result.heldout.items()},
                   heldout=result.heldout)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
