"""KVzap (kvpress KVzapPress; Jegou et al. 2026, https://arxiv.org/abs/2601.07891): a small
model of each token's attention input predicts what KVzip+ would score it.

KVzip+ (`kvzip:plus=true`) is accurate and slow: it runs the model over the
context a second time. KVzap learns it once per model: per layer, a linear map
or a two-layer MLP (GELU) from the layer's attention input `h` [hidden] (after
the input norm) to `log` of the token's KVzip+ score, one output per KV head.
At run time the scores cost one small matmul per token, in prefill and decode
alike: the model evaluates the surrogate as each token enters
(`StatsSpec(token_scores=...)`, `kvjax.core.stats.observe`) and the scores
arrive by position in `LayerStats.position_scores`; `kvzap` keeps, per layer
and KV head, the best-scored tokens (kvpress's ScorerPress rule: a
`scored_policy`, so budgets, schedules and head-wise budgets are shared).

The weights are a `KVzapModel`, saved and read with orbax. kvpress downloads
NVIDIA's (`nvidia/KVzap-{linear,mlp}-<model>`, for a few large models);
`kvjax calibrate --kvzap --out DIR` trains them for any model kvjax loads, as
kvpress's `kvzap/train.py` does: KVzip+ scores of real text as targets, the
linear map by ridge regression, the MLP with optax (AdamW, cosine schedule,
gradient clipping), both on the log scores with a squared error.

Example:
    >>> import numpy as np, jax.numpy as jnp
    >>> w = np.zeros((2, 8, 3), np.float32); w[:, 0, 1] = 1.0   # 2 layers, hidden 8, 3 KV heads
    >>> surrogate = KVzapModel(w1=w, b1=np.zeros((2, 3), np.float32))
    >>> h = jnp.zeros((1, 2, 8)).at[0, 1, 0].set(5.0)          # two tokens' attention inputs
    >>> surrogate.apply(surrogate.layer_params(1), h)[0].tolist()   # [T, KVH]
    [[0.0, 0.0, 0.0], [0.0, 5.0, 0.0]]
    >>> t = kvzap(ratio=0.5, weights=surrogate)                 # or weights=DIR (orbax)
    >>> t.stats.token_scores is surrogate
    True
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.core.stats import StatsSpec
from kvjax.core.transforms import CacheTransform
from kvjax.policies.eviction import ByContent, check_real, no_protect, scored_policy
from kvjax.policies.eviction_kvzip import slot_scores
from kvjax.policies.eviction_wrappers import threshold_policy

KINDS = ("linear", "mlp")


class LayerScorer(ByContent):
    """What KVzap's surrogate and Fast KVzip's gates share: per-layer arrays stacked over
    layers that score each token from its attention input (`StatsSpec.token_scores`), saved
    with orbax. A subclass sets `METHOD` and `ARTIFACT` (its spec's name and argument) and has
    `num_layers`, `hidden_size`, `kv_heads`, `layer_params` and `apply`."""

    METHOD = ""
    ARTIFACT = ""

    def predict(self, inputs: np.ndarray) -> np.ndarray:
        """[N, L, hidden] attention inputs of every layer -> [N, L, KVH] float32 scores."""
        return np.stack([np.asarray(self.apply(self.layer_params(i), inputs[:, i]))
                         for i in range(self.num_layers)], 1)

    def check_model(self, num_layers: int, hidden_size: int, kv_heads: int) -> None:
        """ValueError unless these arrays were made for a model of this shape."""
        got = (self.num_layers, self.hidden_size, self.kv_heads)
        if got != (num_layers, hidden_size, kv_heads):
            raise ValueError(
                f"{self.METHOD}: the {self.ARTIFACT} are for a model of {got[0]} layers, hidden "
                f"size {got[1]} and {got[2]} KV heads; this model has {num_layers}, "
                f"{hidden_size} and {kv_heads}: train its own with `kvjax calibrate "
                f"--{self.METHOD} --out DIR`")

    def save_arrays(self, path: str | os.PathLike, arrays: dict) -> None:
        """Write `arrays` as an orbax checkpoint at `path` (a new directory)."""
        import orbax.checkpoint as ocp
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(Path(path).absolute(), arrays)
        checkpointer.wait_until_finished()


def restore_arrays(path: str | os.PathLike, method: str, artifact: str) -> dict:
    """The dict of arrays a `LayerScorer` saved at `path`; a ValueError naming `method`,
    `artifact` and the path when it is not an orbax checkpoint or cannot be read."""
    folder = Path(path)
    if not (folder / "_CHECKPOINT_METADATA").is_file():
        raise ValueError(f"{method}: {artifact}={str(path)!r} is not an orbax checkpoint "
                         f"directory; give the DIR that `kvjax calibrate --{method} --out DIR` "
                         f"writes")
    import orbax.checkpoint as ocp
    try:
        restored = ocp.StandardCheckpointer().restore(folder.absolute())
    except Exception as e:  # orbax raises several kinds for a damaged checkpoint
        raise ValueError(f"{method}: {artifact}={str(path)!r} could not be read ({e})") from None
    if not isinstance(restored, dict):
        raise ValueError(f"{method}: {artifact}={str(path)!r} holds a {type(restored)}, not "
                         f"named arrays")
    return restored


@dataclasses.dataclass(frozen=True, eq=False)
class KVzapModel(LayerScorer):
    """Per-layer surrogate weights, stacked over layers (float32). Linear: `h @ w1 + b1`;
    MLP: `gelu(h @ w1 + b1) @ w2 + b2` (exact GELU, torch's `nn.GELU()`). Hashed by content:
    it keys compilation through `StatsSpec.token_scores`."""

    w1: np.ndarray  # [L, hidden, M] (linear: M = KVH)
    b1: np.ndarray  # [L, M]
    w2: np.ndarray | None = None  # [L, M, KVH]: present for the MLP
    b2: np.ndarray | None = None  # [L, KVH]

    METHOD = "kvzap"
    ARTIFACT = "weights"

    def __post_init__(self):
        arrays = {"w1": self.w1, "b1": self.b1, "w2": self.w2, "b2": self.b2}
        if (self.w2 is None) != (self.b2 is None):
            raise ValueError("KVzapModel: give both w2 and b2 (an MLP) or neither (linear)")
        for name, a in arrays.items():
            if a is not None and not (isinstance(a, np.ndarray) and a.dtype == np.float32):
                raise ValueError(f"KVzapModel: {name} must be a float32 numpy array, got "
                                 f"{type(a).__name__} {getattr(a, 'dtype', '')}")
        layers, hidden, m = self.w1.shape if self.w1.ndim == 3 else (0, 0, 0)
        want = {"w1": (layers, hidden, m), "b1": (layers, m)}
        if self.w2 is not None:
            kvh = self.w2.shape[-1] if self.w2.ndim == 3 else 0
            want |= {"w2": (layers, m, kvh), "b2": (layers, kvh)}
        for name, shape in want.items():
            if arrays[name].shape != shape or 0 in shape:
                raise ValueError(f"KVzapModel: {name} has shape {arrays[name].shape}, expected "
                                 f"{shape} (w1 [L, hidden, M] sets L, hidden and M)")
        for name, a in arrays.items():
            if a is not None and not np.isfinite(a).all():
                raise ValueError(f"KVzapModel: {name} is not all finite")

    @property
    def kind(self) -> str:
        return "linear" if self.w2 is None else "mlp"

    @property
    def num_layers(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w1.shape[1]

    @property
    def kv_heads(self) -> int:
        return (self.w1 if self.w2 is None else self.w2).shape[-1]

    def layer_params(self, index: int) -> dict[str, jax.Array]:
        """Layer `index`'s weights (they ride in `LayerStats.scorer`)."""
        names = ("w1", "b1") if self.w2 is None else ("w1", "b1", "w2", "b2")
        return {n: jnp.asarray(getattr(self, n)[index]) for n in names}

    @staticmethod
    def apply(params: dict[str, jax.Array], inputs: jax.Array) -> jax.Array:
        """[..., hidden] attention inputs -> [..., KVH] float32 predicted log KVzip+ scores."""
        hi = jax.lax.Precision.HIGHEST
        x = jnp.matmul(inputs.astype(jnp.float32), params["w1"], precision=hi) + params["b1"]
        if "w2" in params:
            x = jnp.matmul(jax.nn.gelu(x, approximate=False), params["w2"],
                           precision=hi) + params["b2"]
        return x

    def save(self, path: str | os.PathLike) -> None:
        """Write the weights as an orbax checkpoint at `path` (a new directory)."""
        self.save_arrays(path, {n: getattr(self, n) for n in ("w1", "b1", "w2", "b2")
                                if getattr(self, n) is not None})


def load_kvzap(path: str | os.PathLike) -> KVzapModel:
    """The `KVzapModel` saved at `path` (`KVzapModel.save`, `kvjax calibrate --kvzap`); a
    ValueError naming the path when it is not such a checkpoint."""
    restored = restore_arrays(path, "kvzap", "weights")
    if not {"w1", "b1"} <= set(restored) or not set(restored) <= {"w1", "b1", "w2", "b2"}:
        raise ValueError(f"kvzap: weights={str(path)!r} holds {sorted(restored)}, not w1, b1 "
                         f"(linear) or w1, b1, w2, b2 (MLP)")
    return KVzapModel(**{k: np.asarray(v, np.float32) for k, v in restored.items()})


def kvzap_scores(layer, stats, budget, key):
    """Each slot's predicted log KVzip+ score, read by position from the scores the model wrote
    as the tokens entered (`LayerStats.position_scores`)."""
    if stats is None or stats.position_scores is None or stats.scorer is None:
        raise ValueError("kvzap scores tokens as the model runs them (StatsSpec.token_scores): "
                         "these statistics have no such scores; run it through the sampler "
                         "(models.sampler), which collects what the transform's stats ask")
    return slot_scores(stats.position_scores, layer.pos), no_protect(layer)


def kvzap(ratio: float | None = None, budget: int | None = None,
          weights: str | os.PathLike | KVzapModel | None = None,
          threshold: float | None = None, window: int | None = None,
          **options) -> CacheTransform:
    """KVzap: keep, per layer and KV head, the tokens whose surrogate-predicted KVzip+ score is
    highest (kvpress `KVzapPress` under its ScorerPress rule: `ratio` or `budget`), or, with
    `threshold`, every token whose score is at least `threshold` plus the newest `window`
    (default 128) of each row (kvpress `DMSPress(KVzapPress(), threshold, window)`, the
    paper's use; `kvjax.policies.eviction_wrappers.dms`'s rule; the kept count then follows
    the text).

    `weights`: a `KVzapModel` or the orbax directory `kvjax calibrate --kvzap --out DIR`
    writes (made for the model it runs with: checked when the statistics are made).
    Positions scored are those below the capacity the statistics were made for (a prefill's:
    prompt plus room). `options`: `schedule`, `headwise`, `alpha` of `scored_policy`; with
    `threshold` only `headwise` (default true: heads share a pooled row, so the evicted
    tokens' bytes are freed; false: a row per head, as KIVI after it needs).
    """
    if weights is None:
        raise ValueError("kvzap: needs weights=DIR, the surrogate that `kvjax calibrate "
                         "--kvzap --out DIR` trains for the model")
    if threshold is None:
        if window is not None:
            raise ValueError(f"kvzap: window={window!r} goes with threshold= (DMSPress's rule); "
                             "with ratio or budget every token is ranked")
    else:
        headwise = options.pop("headwise", True)
        if ratio is not None or budget is not None or options:
            raise ValueError(f"kvzap: threshold={threshold!r} decides the kept count; give no "
                             f"ratio, budget or {', '.join(options) or 'scored-policy option'}")
        window = 128 if window is None else window
    surrogate = weights if isinstance(weights, KVzapModel) else load_kvzap(weights)
    stats = StatsSpec(token_scores=surrogate)
    if threshold is not None:
        return threshold_policy("kvzap", kvzap_scores, stats, threshold, window, headwise)
    return scored_policy("kvzap", kvzap_scores, ratio=ratio, budget=budget, stats=stats,
                         **options)


# ----------------------------------------------------------------------------- training


def fit_linear(inputs: np.ndarray, targets: np.ndarray, alpha: float = 1.0) -> KVzapModel:
    """Ridge regression per layer (scikit-learn's `Ridge(alpha)` with an intercept, as
    kvpress's `train_linear`): `inputs` [N, L, hidden], `targets` [N, L, KVH] log scores.

    Example:
        >>> rng = np.random.default_rng(0)
        >>> x = rng.normal(size=(200, 1, 4)).astype(np.float32)
        >>> y = x @ np.array([[1.0], [2.0], [0.0], [-1.0]], np.float32) + 3.0   # [200, 1, 1]
        >>> m = fit_linear(x, y, alpha=1e-6)
        >>> np.round(m.w1[0, :, 0], 3).tolist(), round(float(m.b1[0, 0]), 3)
        ([1.0, 2.0, 0.0, -1.0], 3.0)
    """
    _check_data(inputs, targets)
    check_real("fit_linear", "alpha", alpha, 0.0)
    x, y = inputs.astype(np.float64), targets.astype(np.float64)
    xm, ym = x.mean(axis=0), y.mean(axis=0)  # [L, hidden], [L, KVH]
    xc, yc = (x - xm).transpose(1, 0, 2), (y - ym).transpose(1, 0, 2)  # [L, N, .]
    gram = xc.transpose(0, 2, 1) @ xc + alpha * np.eye(x.shape[-1])  # [L, hidden, hidden]
    w = np.linalg.solve(gram, xc.transpose(0, 2, 1) @ yc)  # [L, hidden, KVH]
    b = ym - (xm[:, None, :] @ w)[:, 0]
    return KVzapModel(w1=w.astype(np.float32), b1=b.astype(np.float32))


def fit_mlp(inputs: np.ndarray, targets: np.ndarray, hidden: int = 64, epochs: int = 40,
            lr: float = 1e-3, batch: int = 256, seed: int = 0) -> KVzapModel:
    """A two-layer MLP per layer trained with optax on the squared error (kvpress's
    `train_mlp`: AdamW, a cosine schedule over the epochs, gradient norm clipped at 1, shuffled
    batches). `inputs` [N, L, hidden], `targets` [N, L, KVH] log scores. The defaults suit
    ~10^4 samples (`kvjax calibrate --kvzap`'s); kvpress's (512 units, 15 epochs, lr 5e-3,
    batches of 512) are for its ~2 million."""
    import optax

    _check_data(inputs, targets)
    for arg, value in (("hidden", hidden), ("epochs", epochs), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"fit_mlp: {arg} must be an int >= 1, got {value!r}")
    check_real("fit_mlp", "lr", lr, 1e-12)
    n, layers, width = inputs.shape
    kvh = targets.shape[-1]
    k1, k2 = jax.random.split(jax.random.key(seed))
    uniform = lambda k, shape, fan_in: jax.random.uniform(  # torch nn.Linear's initialisation
        k, shape, jnp.float32, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
    params = {"w1": uniform(k1, (layers, width, hidden), width), "b1": jnp.zeros((layers, hidden)),
              "w2": uniform(k2, (layers, hidden, kvh), hidden), "b2": jnp.zeros((layers, kvh))}
    steps_per_epoch = max(n // batch, 1)
    schedule = optax.cosine_decay_schedule(lr, epochs * steps_per_epoch)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
    state = opt.init(params)
    per_layer = jax.vmap(KVzapModel.apply, in_axes=(0, 1), out_axes=1)  # layers on axis 1

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((per_layer(p, x) - y) ** 2))(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    x_all, y_all = jnp.asarray(inputs, jnp.float32), jnp.asarray(targets, jnp.float32)
    rng = np.random.default_rng(seed)
    for _ in range(epochs):
        order = rng.permutation(n)
        for i in range(steps_per_epoch):
            take = order[i * batch:(i + 1) * batch]
            params, state, _ = step(params, state, x_all[take], y_all[take])
    return KVzapModel(**{k: np.asarray(v, np.float32) for k, v in params.items()})


def fit_quality(surrogate: LayerScorer, inputs: np.ndarray, targets: np.ndarray) -> dict:
    """How well `surrogate` predicts `targets` [N, L, KVH] from `inputs` [N, L, hidden]: R^2
    (1 - mean squared error / mean variance of the targets) and Spearman's rank correlation
    over the N tokens, averaged over layers and KV heads.

    Example:
        >>> x = np.arange(12, dtype=np.float32).reshape(6, 1, 2)
        >>> m = KVzapModel(w1=np.ones((1, 2, 1), np.float32), b1=np.zeros((1, 1), np.float32))
        >>> fit_quality(m, x, m.predict(x))
        {'r2': 1.0, 'spearman': 1.0}
    """
    predicted = surrogate.predict(inputs).astype(np.float64)
    r2 = 1 - ((predicted - targets) ** 2).mean() / targets.var(axis=0).mean()
    rank = lambda a: np.argsort(np.argsort(a, axis=0), axis=0).astype(np.float64)
    ra, rb = rank(predicted), rank(targets)
    ra, rb = ra - ra.mean(0), rb - rb.mean(0)
    spearman = ((ra * rb).sum(0) / np.sqrt((ra ** 2).sum(0) * (rb ** 2).sum(0))).mean()
    return {"r2": round(float(r2), 4), "spearman": round(float(spearman), 4)}


def check_training_shapes(who: str, inputs: np.ndarray, targets: np.ndarray) -> None:
    """ValueError naming `who` unless `inputs` [N, L, hidden] and `targets` [N, L, KVH] share
    N >= 2 and L (a token scorer's training data: KVzap's, Fast KVzip's)."""
    if inputs.ndim != 3 or targets.ndim != 3 or inputs.shape[:2] != targets.shape[:2] or \
            inputs.shape[0] < 2:
        raise ValueError(f"{who} wants inputs [N, L, hidden] and targets [N, L, KVH] "
                         f"with the same N >= 2 and L; got {inputs.shape} and {targets.shape}")


def _check_data(inputs: np.ndarray, targets: np.ndarray) -> None:
    check_training_shapes("KVzap training", inputs, targets)
    if not (np.isfinite(inputs).all() and np.isfinite(targets).all()):
        raise ValueError("KVzap training data is not all finite (a zero KVzip+ score has no log)")
