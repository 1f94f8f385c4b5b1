"""Train `auto`'s learned controller: a small MLP from per-(layer, config) signals to the
log of the measured damage, with optax, on the calibration text's table; saved with orbax.

    python experiments/eval/calibrate_planner.py     # the table and signals (Devil's Dictionary)
    python experiments/eval/train_planner.py         # -> kvjax/policies/planner_controller/

The controller never sees the evaluation text. It is fitted on half the layers and scored
on the other half (Spearman rank correlation of predicted against measured damage, printed
and stored in the calibration file's `controller` entry), then refitted on all layers.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from experiments.eval.rank_stats import spearman
from kvjax.policies import planner


def init_params(key, num_signals: int, hidden: int, mean, scale) -> dict:
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (num_signals, hidden)) / np.sqrt(num_signals),
            "b1": jnp.zeros(hidden),
            "w2": jax.random.normal(k2, (hidden, 1)) / np.sqrt(hidden),
            "b2": jnp.zeros(1), "mean": jnp.asarray(mean), "scale": jnp.asarray(scale)}


def fit(signals: np.ndarray, target: np.ndarray, *, hidden: int = 16, steps: int = 2000,
        lr: float = 1e-2, seed: int = 0) -> dict:
    """MLP parameters minimising the squared error of `controller_apply(signals)` against
    `target` (log damage); the input normalisation is frozen from the training signals."""
    x, y = jnp.asarray(signals, jnp.float32), jnp.asarray(target, jnp.float32)
    params = init_params(jax.random.key(seed), x.shape[-1], hidden, x.mean(0),
                         x.std(0) + 1e-6)
    trainable = {k: v for k, v in params.items() if k not in ("mean", "scale")}
    frozen = {k: params[k] for k in ("mean", "scale")}
    opt = optax.adam(lr)
    state = opt.init(trainable)

    @jax.jit
    def step(trainable, state):
        loss_fn = lambda p: jnp.mean((planner.controller_apply(p | frozen, x) - y) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(trainable)
        updates, state = opt.update(grads, state)
        return optax.apply_updates(trainable, updates), state, loss

    for _ in range(steps):
        trainable, state, loss = step(trainable, state)
    return {k: np.asarray(v) for k, v in (trainable | frozen).items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", type=Path, default=planner.CALIBRATION)
    ap.add_argument("--out", type=Path, default=planner.CONTROLLER)
    args = ap.parse_args(argv)
    cal = json.loads(args.calibration.read_text())
    signals = np.asarray(cal["signals"], np.float32)  # [L, K, S]
    target = np.log(np.asarray(cal["damage"], np.float32) + 1e-4)  # [L, K]
    layers = np.arange(len(signals))
    train, held = layers % 2 == 0, layers % 2 == 1
    flat = lambda a, m: a[m].reshape(-1, *a.shape[2:])
    params = fit(flat(signals, train), flat(target, train))
    predicted = np.asarray(planner.controller_apply(params, jnp.asarray(flat(signals, held))))
    score = spearman(predicted, flat(target, held))
    params = fit(signals.reshape(-1, signals.shape[-1]), target.reshape(-1))
    if args.out.exists():
        shutil.rmtree(args.out)
    import orbax.checkpoint as ocp
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(args.out.absolute(), params)
    checkpointer.wait_until_finished()
    cal["controller"] = {"held_out_layers_spearman": round(score, 4),
                         "parameters": int(sum(np.size(v) for v in params.values()))}
    args.calibration.write_text(json.dumps(cal) + "\n")
    print(f"controller: Spearman {score:.3f} on held-out layers; "
          f"{cal['controller']['parameters']} parameters -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
