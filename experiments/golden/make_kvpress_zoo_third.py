"""Goldens for EntropyGatedChunkKVPress: ``python experiments/golden/make_kvpress_zoo_third.py``.

What it makes
-------------
``tests/golden/kvpress_zoo_third.npz``, made by running kvpress 0.5.5 (never
kvjax) on the real SmolLM2-135M-Instruct, the same GGUF, transformers model,
sdpa attention and the same two passages as ``kvpress_zoo.npz`` (640 and 300
tokens of The Devil's Dictionary), batch 1, one prefill forward with
``with press(model):`` per case. Key prefix ``ctx{c}_{press}_r{r:.2f}``:

* ``entropy_chunkkv_snapkv``: ``EntropyGatedChunkKVPress(press=SnapKVPress(
  compression_ratio=r))`` (chunk_length 10, low_entropy_chunk_length 4), r in
  0.5, 0.75; ``entropy_chunkkv_knorm``: the same around ``KnormPress``.
  ``..._keep``: packbits of the bool [L, KVH, T] keep mask, read off the cache
  kvpress returned (every kept key row matched bit for bit to its input row).

* ``qfilter``: ``QFilterPress(compression_ratio=r)``, r in 0.5, 0.75, given the filters
  ``qfilter_filters`` float32 [L, KVH, D] (standard normal, seeded) in place of the hub's
  (``nthngdy/<model>_qfilt``, out of reach): kvpress's scoring and selection on the real
  model; the filters' rule is checked apart (``tests/test_qfilter.py``).

* ``lukv``: ``LUKVPress(compression_ratio=r)`` (its default ExpectedAttentionPress with
  epsilon 2e-2, sink 4, window 1), r in 0.5, 0.75, given the budget curve ``lukv_curve``
  float32 [99, L, KVH] (uniform in [0.05, 0.95], seeded) in place of a published one (kvpress
  has one, for Llama-3.1-8B). LU-KV masks rather than evicts: ``..._keep`` is the complement of
  each layer's ``masked_key_indices``.

* ``fastkvzip``: ``FastKVzipPress(compression_ratio=r)`` at its defaults (global across
  layers, 4 sinks, a 2% window), r in 0.5, 0.75, given the gates ``fastkvzip_gates`` (seeded
  normal arrays) in place of the paper's (``Jang-Hyun/Fast-KVzip``, for a few large models).
  It masks rather than evicts: ``..._keep`` is the complement of each layer's
  ``masked_key_indices``.

* ``chunk_knorm`` / ``chunk_keydiff``: ``ChunkPress(press=KnormPress(r) | KeyDiffPress(r),
  chunk_length=128)``, r in 0.3, 0.75 (at 0.3 the chunks' kept counts, ``max(1, int(n_c
  0.7))``, sum to fewer than ``int(n 0.7)``: 208 against 210 in 300 tokens).

* ``chunk_snapkv`` / ``chunk_tova``: ``ChunkPress(press=SnapKVPress(r) | TOVAPress(r),
  chunk_length=160)``, r in 0.3, 0.75: each chunk scored by its own last queries (64 for
  SnapKV, 1 for TOVA), which kvpress rotates at the prompt's last positions.

* ``kvcompose``: ``KVComposePress(compression_ratio=r)`` at its defaults (structured), r in
  0.5, 0.75: its second pass over the context and its per-layer budgets, read off the cache it
  leaves (every kept key row matched to the uncompressed prefill's).

* ``expected_attention_stats``: ``ExpectedAttentionStatsPress(compression_ratio=r)``, r in
  0.5, 0.75, given query statistics in place of the hub's: ``query_stats`` (seeded, made again
  from the seed by the test, not stored: a mean and a positive semi-definite covariance per
  layer and query head).

* ``kvzap_linear`` / ``kvzap_mlp``: ``KVzapPress(model_type=...)`` under its ScorerPress rule
  (``compression_ratio=r``), r in 0.5, 0.75, given surrogate weights in place of NVIDIA's
  (``nvidia/KVzap-<type>-<model>``, published for a few large models only): ``kvzap_weights``
  (seeded, made again from the seed by the test, not stored; the MLP with 16 hidden units).
  ``kvzap_dms_linear`` / ``kvzap_dms_mlp``: the paper's use, ``DMSPress(KVzapPress(...),
  threshold=t)`` (sliding window 128, prefill only) with the same weights, t in -0.5 and 0.5
  (the ``_r`` of these keys is the threshold). DMSPress masks rather than evicts: ``..._keep``
  is the complement of each layer's ``masked_key_indices``.

* ``dms_knorm`` / ``dms_snapkv``: ``DMSPress(KnormPress())`` and ``DMSPress(SnapKVPress())``
  at their defaults, thresholds near the 30th and 70th percentile of the scores on ctx1
  (knorm -17.8, -14.1; snapkv 3e-5, 3e-4; the ``_r`` of the keys), kept as for ``kvzap_dms``.

RestoreKVPress is not here: it loads LoRA adapters and restore embeddings
from the hub (``higokri/RestoreKV-<model>``, published for Llama-3.1-8B and
Qwen3-8B only), so kvpress cannot run it on SmolLM2 offline (docs/DECISIONS.md).

How to run (the ``compare`` extra; about a minute on 2 busy CPU cores)::

    python experiments/golden/make_kvpress_zoo_third.py [--gguf PATH] [--out PATH] [--only NAMES]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from experiments.eval.hf_reference import DEFAULT_GGUF, load_hf_reference, save_golden
from experiments.golden.make_kvpress import (ATTN, CONTEXTS, PASSAGE_CHARS, REPO_ROOT, SEED,
                                             TEXT_PATH)
from experiments.golden.make_kvpress_zoo import kept_from_cache, provenance

THIRD_OUT = REPO_ROOT / "tests" / "golden" / "kvpress_zoo_third.npz"
RATIOS = {"entropy_chunkkv_snapkv": (0.5, 0.75), "entropy_chunkkv_knorm": (0.5, 0.75),
          "qfilter": (0.5, 0.75), "lukv": (0.5, 0.75), "kvcompose": (0.5, 0.75),
          "expected_attention_stats": (0.5, 0.75), "kvzap_linear": (0.5, 0.75),
          "kvzap_mlp": (0.5, 0.75), "kvzap_dms_linear": (-0.5, 0.5),
          "kvzap_dms_mlp": (-0.5, 0.5),  # dms: thresholds, near the 30th/70th score percentiles
          "fastkvzip": (0.5, 0.75),
          "chunk_knorm": (0.3, 0.75), "chunk_keydiff": (0.3, 0.75),  # 0.3: floors that differ
          "chunk_snapkv": (0.3, 0.75), "chunk_tova": (0.3, 0.75),
          "dms_knorm": (-17.8, -14.1), "dms_snapkv": (3e-5, 3e-4)}
THIRD_PRESSES = list(RATIOS)


def qfilter_filters(n_layers: int, kvh: int, head_dim: int) -> np.ndarray:
    """The golden's stand-in for the hub's Q-Filters: [L, KVH, D] float32 standard normal."""
    return np.random.default_rng(SEED).standard_normal((n_layers, kvh, head_dim)).astype(
        np.float32)


def query_stats(n_layers: int, heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The golden's stand-in for the hub's query statistics: (mean [L, H, D], covariance
    [L, H, D, D] = A A^T / D) float32, from a seeded generator."""
    rng = np.random.default_rng(SEED + 2)
    mean = rng.standard_normal((n_layers, heads, head_dim)).astype(np.float32)
    a = rng.standard_normal((n_layers, heads, head_dim, head_dim))
    return mean, (a @ a.transpose(0, 1, 3, 2) / head_dim).astype(np.float32)


def kvzap_weights(kind: str, n_layers: int, hidden: int, kvh: int) -> dict[str, np.ndarray]:
    """The golden's stand-in for NVIDIA's KVzap weights: float32 arrays stacked over layers,
    ``w1`` [L, hidden, M] and ``b1`` [L, M] (linear: M = KVH), and for the MLP (M = 16) ``w2``
    [L, M, KVH] and ``b2`` [L, KVH]; normal, scaled by 1/sqrt(fan-in), from a seeded generator."""
    rng = np.random.default_rng(SEED + (3 if kind == "linear" else 4))
    m = kvh if kind == "linear" else 16
    dense = lambda fan_in, *shape: (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(
        np.float32)
    out = {"w1": dense(hidden, n_layers, hidden, m), "b1": dense(1, n_layers, m)}
    if kind == "mlp":
        out |= {"w2": dense(m, n_layers, m, kvh), "b2": dense(1, n_layers, kvh)}
    return out


CHUNK = 128  # ChunkPress's chunk_length in the golden (kvpress's default 1,024 is one chunk)
# around SnapKV and TOVA: every chunk must be longer than SnapKV's 64-query window (kvpress
# asserts it), so 160: four whole chunks of 640, and 160 + 140 of 300
WINDOW_CHUNK = 160


def fastkvzip_gates(n_layers: int, hidden: int, kvh: int, groups: int):
    """The golden's stand-in for the paper's trained gates (`Jang-Hyun/Fast-KVzip`, published
    for a few large models): a kvjax `FastKVzipGates` of width 16 with 16 sink keys, every
    array normal from a seeded generator (projections scaled by 1/sqrt(hidden), norms about 1,
    sink keys and biases of unit scale, so scores spread over (0, 1))."""
    from kvjax.policies.eviction_fastkvzip import FastKVzipGates

    rng = np.random.default_rng(SEED + 5)
    normal = lambda scale, *shape: (rng.standard_normal(shape) * scale).astype(np.float32)
    dim, sink = 16, 16
    return FastKVzipGates(q_proj=normal(hidden ** -0.5, n_layers, hidden, kvh * groups * dim),
                          q_bias=normal(0.1, n_layers, kvh * groups * dim),
                          k_proj=normal(hidden ** -0.5, n_layers, hidden, kvh * dim),
                          q_norm=1 + normal(0.1, n_layers, dim),
                          k_norm=1 + normal(0.1, n_layers, dim),
                          k_base=normal(1.0, n_layers, kvh, sink, dim),
                          bias=normal(1.0, n_layers, kvh, groups))


def lukv_curve(n_layers: int, kvh: int) -> np.ndarray:
    """The golden's budget curve: [99, L, KVH] float32 prune ratios, uniform in [0.05, 0.95]."""
    return np.random.default_rng(SEED + 1).uniform(0.05, 0.95, (99, n_layers, kvh)).astype(
        np.float32)


def given_kvzap(kind: str, ratio: float, weights: dict[str, np.ndarray]):
    """kvpress's KVzapPress(model_type=kind, compression_ratio=ratio) whose surrogate is a
    kvpress `KVzapModel` holding `weights`."""
    import kvpress

    from experiments.eval.kvpress_engine import kvpress_kvzap_model
    from kvjax.policies.eviction_kvzap import KVzapModel

    surrogate = kvpress_kvzap_model(KVzapModel(**weights))

    class GivenWeights(kvpress.KVzapPress):  # the hub download replaced by `weights`
        def post_init_from_model(self, model):
            self.kvzap_model = surrogate

    return GivenWeights(compression_ratio=ratio, model_type=kind)


def make_third_press(name: str, ratio: float, filters: np.ndarray | None = None,
                     curve: np.ndarray | None = None, stats: tuple | None = None,
                     kvzap: dict | None = None, gates=None):
    """The kvpress press of `name` at `ratio`, every other argument at kvpress's default."""
    import kvpress

    if name == "kvcompose":
        return kvpress.KVComposePress(compression_ratio=ratio)
    if name == "expected_attention_stats":
        import torch

        press = kvpress.ExpectedAttentionStatsPress(compression_ratio=ratio)
        press.mu, press.cov = (torch.from_numpy(x) for x in stats)  # post_init loads no others
        return press
    if name == "lukv":
        class GivenCurve(kvpress.LUKVPress):  # no published curve for SmolLM2: the golden's
            def _load_budget_curves(self, model):
                return curve

        return GivenCurve(compression_ratio=ratio)

    if name == "qfilter":
        import torch

        class GivenFilters(kvpress.QFilterPress):  # the hub download replaced by `filters`
            def post_init_from_model(self, model):
                self.q_filters = torch.from_numpy(filters).to(model.dtype)

        return GivenFilters(compression_ratio=ratio)
    if name.startswith("dms_"):  # `ratio` is DMSPress's threshold
        inner = {"knorm": kvpress.KnormPress, "snapkv": kvpress.SnapKVPress}[name[4:]]()
        return kvpress.DMSPress(press=inner, threshold=ratio)
    if name.startswith("kvzap_dms_"):  # `ratio` is DMSPress's threshold
        inner = given_kvzap(name[len("kvzap_dms_"):], 0.0, kvzap)
        return kvpress.DMSPress(press=inner, threshold=ratio)
    if name.startswith("kvzap_"):
        return given_kvzap(name[len("kvzap_"):], ratio, kvzap)
    if name.startswith("chunk_"):  # 128 tokens (five in 640, three in 300); 160 around a window
        press = {"knorm": kvpress.KnormPress, "keydiff": kvpress.KeyDiffPress,
                 "snapkv": kvpress.SnapKVPress, "tova": kvpress.TOVAPress}[name[6:]]
        length = WINDOW_CHUNK if name[6:] in ("snapkv", "tova") else CHUNK
        return kvpress.ChunkPress(press=press(compression_ratio=ratio), chunk_length=length)
    if name == "fastkvzip":  # the hub download replaced by the golden's gates
        from experiments.eval.kvpress_engine import kvpress_fastkvzip_gates

        press = kvpress.FastKVzipPress(compression_ratio=ratio)
        press.gates = kvpress_fastkvzip_gates(gates)
        return press
    inner = {"snapkv": kvpress.SnapKVPress, "knorm": kvpress.KnormPress}
    if name.startswith("entropy_chunkkv_"):
        press = inner[name[len("entropy_chunkkv_"):]](compression_ratio=ratio)
        return kvpress.EntropyGatedChunkKVPress(press=press)
    raise ValueError(name)


def run_third_press(model, torch, ids: np.ndarray, name: str, ratio: float, n_layers: int,
                    kvh: int) -> dict[str, np.ndarray]:
    """One prefill with the press active -> the arrays this case stores (unpacked)."""
    from transformers import DynamicCache

    head_dim = model.config.hidden_size // model.config.num_attention_heads
    press = make_third_press(name, ratio, qfilter_filters(n_layers, kvh, head_dim),
                             lukv_curve(n_layers, kvh),
                             query_stats(n_layers, model.config.num_attention_heads, head_dim),
                             kvzap_weights(name.rsplit("_", 1)[1], n_layers,
                                           model.config.hidden_size, kvh)
                             if name.startswith("kvzap_") else None,
                             fastkvzip_gates(n_layers, model.config.hidden_size, kvh,
                                             model.config.num_attention_heads // kvh)
                             if name == "fastkvzip" else None)
    if name == "kvcompose":  # compresses the cache when its block exits, not in `compress`
        inp = torch.from_numpy(ids.astype(np.int64))[None]
        with torch.no_grad():
            saved, model.config._attn_implementation = model.config._attn_implementation, "eager"
            try:  # KVCompose prefills with eager attention: the same keys, bit for bit
                plain = model(input_ids=inp, past_key_values=DynamicCache(), use_cache=True)
            finally:
                model.config._attn_implementation = saved
            with press(model):
                out = model(input_ids=inp, past_key_values=DynamicCache(), use_cache=True)
        keep = np.zeros((n_layers, kvh, len(ids)), bool)
        for i in range(n_layers):
            keep[i] = kept_from_cache(plain.past_key_values.layers[i].keys,
                                      out.past_key_values.layers[i].keys)
        return {"keep": keep}
    if name in ("lukv", "fastkvzip") or "dms_" in name:  # masks: the kept positions are the
        # complement of the masked ones
        inp = torch.from_numpy(ids.astype(np.int64))[None]
        with torch.no_grad(), press(model):
            model(input_ids=inp, past_key_values=DynamicCache(), use_cache=True)
        keep = np.ones((n_layers, kvh, len(ids)), bool)
        for i, layer in enumerate(model.model.layers):
            if layer.self_attn.masked_key_indices is None:  # nothing masked in this layer
                continue
            b, h, s = (x.numpy() for x in layer.self_attn.masked_key_indices)
            assert (b == 0).all()
            keep[i, h, s] = False
            layer.self_attn.masked_key_indices = None
        return {"keep": keep}
    keep = np.zeros((n_layers, kvh, len(ids)), bool)
    orig_compress = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        original_keys = keys.clone()
        new_k, new_v = orig_compress(module, hidden_states, keys, values, attentions, kwargs)
        keep[module.layer_idx] = kept_from_cache(original_keys, new_k)
        return new_k, new_v

    press.compress = compress
    inp = torch.from_numpy(ids.astype(np.int64))[None]
    with torch.no_grad(), press(model):
        out = model(input_ids=inp, past_key_values=DynamicCache(), use_cache=True)
    lens = np.asarray([out.past_key_values.layers[i].keys.shape[2] for i in range(n_layers)])
    assert (lens == keep.sum(-1)[:, 0]).all(), (lens, keep.sum(-1))
    return {"keep": keep}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="path of the SmolLM2 GGUF file")
    ap.add_argument("--out", default=str(THIRD_OUT), help=f"output .npz (default {THIRD_OUT})")
    ap.add_argument("--only", help="comma-separated names of THIRD_PRESSES (default: all); the "
                                   "rest of an existing --out file is kept")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else THIRD_PRESSES
    unknown = set(names) - set(THIRD_PRESSES)
    if unknown:
        ap.error(f"--only: unknown press {sorted(unknown)}; choose from "
                 f"{', '.join(THIRD_PRESSES)}")
    import torch

    import kvpress  # noqa: F401  (patches the attention functions, as kvpress always does)

    model, tok, info = load_hf_reference(args.gguf, dtype=torch.float32, attn_implementation=ATTN,
                                         seed=SEED)
    timings = dict(info["timings"])
    cfg = model.config
    n_layers, kvh = cfg.num_hidden_layers, cfg.num_key_value_heads
    out: dict[str, np.ndarray] = {}
    if args.only and Path(args.out).exists():
        with np.load(args.out) as old:
            out.update({k: old[k] for k in old.files})
    full = TEXT_PATH.read_text(encoding="utf-8")
    for c, (offset, n) in CONTEXTS.items():
        start = full.index("\n\n", offset) + 2
        text = full[start: start + PASSAGE_CHARS]
        out[f"ctx{c}_ids"] = np.asarray(tok(text, add_special_tokens=False)["input_ids"][:n],
                                        np.int32)
    t0 = time.perf_counter()
    for name in names:
        for c in CONTEXTS:
            ids = out[f"ctx{c}_ids"]
            for ratio in RATIOS[name]:
                t1 = time.perf_counter()
                torch.manual_seed(SEED)
                arrays = run_third_press(model, torch, ids, name, ratio, n_layers, kvh)
                tag = f"{ratio:g}" if "dms_" in name else f"{ratio:.2f}"  # a threshold: as is
                prefix = f"ctx{c}_{name}_r{tag}"
                for key, value in arrays.items():
                    out[f"{prefix}_{key}"] = np.packbits(value.ravel())
                kept = arrays["keep"].sum(-1)
                print(f"{prefix}: kept/row {kept.min()}-{kept.max()} of {len(ids)} "
                      f"({time.perf_counter() - t1:.1f}s)", flush=True)
    timings["presses"] = time.perf_counter() - t0
    if "lukv" in names:
        out["lukv_curve"] = lukv_curve(n_layers, kvh)
    if "qfilter" in names:
        out["qfilter_filters"] = qfilter_filters(n_layers, kvh,
                                                 cfg.hidden_size // cfg.num_attention_heads)
    out.update(provenance(info, n_layers, kvh))
    old = [str(p) for p in out.get("presses", [])]
    out["presses"] = np.asarray(list(dict.fromkeys(old + names)))
    save_golden(args.out, out, timings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
