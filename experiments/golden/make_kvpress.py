"""Make the golden reference file for kvjax's eviction policies (kvpress parity).

What it makes
-------------
``tests/golden/kvpress_golden.npz``: the scores and the kept KV positions of
NVIDIA's ``kvpress`` (PyTorch) presses on the real SmolLM2-135M-Instruct
model, so kvjax's JAX eviction policies can be checked for parity without
torch installed. The model is Hugging Face ``transformers`` + PyTorch
(float32, CPU, ``attn_implementation="sdpa"``) loading the same GGUF file kvjax
loads (``SmolLM2-135M-Instruct.Q4_1.gguf``), with
``experiments/eval/hf_reference.py`` as in ``experiments/golden/make_smollm2.py``. Each press runs exactly as kvpress
runs it at prefill: one forward of the whole context with ``with
press(model):`` active; the press's forward hook on every attention layer
calls ``press.compress`` on that layer's full cache. With sdpa the attention
weights are not returned, so SnapKV/PyramidKV/TOVA score with
``SnapKVPress.compute_window_attention`` (their own re-computation of the
last-window queries' attention). Compression of layer ``l``'s cache does not
change what layer ``l+1`` sees during the prefill forward, so every score
below is a function of the uncompressed model's activations only.

Contexts (prose from ``experiments/data/devils_dictionary.txt``, public
domain; tokenized with ``add_special_tokens=False`` and truncated):

* ``ctx1_ids`` int32 [T1=640], ``ctx1_text`` (str: the passage, cut at the
  end of the T1-th token's characters; it re-tokenizes to exactly
  ``ctx1_ids``), ``ctx1_char_offset`` int32 (where the passage starts in the
  file: just after the first paragraph break at or after character 20000);
* ``ctx2_ids`` int32 [T2=300], ``ctx2_text``, ``ctx2_char_offset``: a second,
  shorter context (from character 40000 on), so tests can batch contexts of
  different lengths.

The ids contain digits' tokens as this (converted GGUF) tokenizer produces
them; tests only use the stored ids.

Per press and compression ratio ``r`` (kvpress's convention: ``r`` is the
fraction of KV pairs REMOVED; ``n_kept = max(1, int(T * (1 - r)))``), with
``L`` layers and ``KVH`` KV heads, key prefix ``ctx{c}_{press}_r{r:.2f}``:

* ``..._keep`` bool [L, KVH, T]: True where kvpress keeps the KV pair of that
  layer, KV head and position. For the ScorerPress presses it is the set
  ``scores.topk(n_kept, dim=-1).indices`` that ``ScorerPress.compress`` gathers
  (the script checks that these indices reproduce the compressed cache
  kvpress returned, element for element); for PyramidKV the top-k uses
  ``get_layer_budget(module, T)`` per layer; for AdaKV it is the complement
  of ``module.masked_key_indices`` (AdaKV does not shrink the cache, it masks
  keys head by head, and its per-head counts differ).
* ``..._scores`` float32 [L, KVH, T]: what the press's ``score(...)`` returned
  (for ``adakv_snapkv``: the inner SnapKVPress's scores, before AdaKV's
  safeguard overwrites the top ``n_safe`` of each head with float32 max).
  Higher = more important; the protected positions (SnapKV/PyramidKV: last
  ``window_size``; TOVA: last position; ExpectedAttention: first ``n_sink``)
  hold ``scores.max() + 1`` where the max is over the whole unpadded tensor of
  that layer (all heads).
* ``..._margin`` float32 [L, KVH] (``adakv_snapkv``: [L], over the flattened
  heads): the smallest kept score minus the largest evicted score (for AdaKV:
  of the safeguarded scores AdaKV ranks; +inf if nothing is evicted). 0 means
  an exact tie straddles the boundary, so which of the tied positions is kept
  is up to torch's CPU ``topk`` tie-breaking; a tiny margin means a
  re-implementation's float rounding may legitimately swap positions there.
  The margins are tiny for the attention-based scores (down to ~1e-9), so a
  parity test should compare keep masks only where the margin is clear, or
  allow swaps among positions whose scores are within tolerance of the
  boundary. In this file the only exact tie is ``ctx2_knorm_r0.50`` layer 0,
  KV head 1 (two positions with bitwise equal key norms: in layer 0 the key
  before RoPE depends on the token id only and RoPE keeps the norm; torch kept
  the higher index).

Presses (all other arguments at kvpress's defaults):

* ``snapkv``: ``SnapKVPress(r)`` (window_size=64, kernel_size=5);
* ``streaming_llm``: ``StreamingLLMPress(r)`` (n_sink=4);
* ``knorm``: ``KnormPress(r)``;
* ``tova``: ``TOVAPress(r)``;
* ``expected_attention``: ``ExpectedAttentionPress(r)`` (n_future_positions=512,
  n_sink=4, use_covariance=True, use_vnorm=True, epsilon=0);
* ``pyramidkv``: ``PyramidKVPress(r)`` (window_size=64, kernel_size=5, beta=20);
* ``adakv_snapkv``: ``AdaKVPress(SnapKVPress(r))`` (alpha_safeguard=0.2).

Keys present: ``ctx1`` at r=0.50 for all seven presses, plus r=0.25 and 0.75
for ``snapkv`` and ``expected_attention``; ``ctx2`` at r=0.50 for ``snapkv``,
``knorm`` and ``expected_attention``. A press's scores do not depend on ``r``
(the script asserts they are bitwise equal across ratios); they are stored
for every ratio anyway so each key prefix is self-contained.

Metadata: ``kvpress_version``, ``transformers_version``, ``torch_version``
(str), ``gguf_sha256``, ``gguf_name`` (str), ``num_layers``, ``kv_heads``,
``num_heads``, ``head_dim`` (int32), ``rope_theta`` (float64),
``attn_implementation`` (str).

Sanity checks (asserted): every ``_keep`` keeps exactly the budget in every
(layer, KV head) (AdaKV: per layer, the sum over heads is ``KVH * n_kept``
and every head keeps at least ``n_safe``); the compressed cache has that many
entries per layer (AdaKV: the cache keeps all T); StreamingLLM keeps
positions ``[0, 4)`` and the last ``n_kept - 4``; SnapKV and PyramidKV keep
the last 64 positions; ExpectedAttention keeps the first 4; TOVA's keep mask
and scores are the same for every KV head; PyramidKV's and AdaKV's inner
scores equal SnapKV's; the kept indices, re-derived from the stashed scores
with the same ``topk`` call, gather exactly the keys and values kvpress left
in the cache (AdaKV: re-deriving its safeguard + global bottom-k gives the same
mask). Boundary ties are not an error; they are printed and ``..._margin``
records them.

The other presses (KeyDiff, LagKV, CUR, Leverage, NonCausalAttn, Compactor, ChunkKV,
BlockPress, KeyRerotation) have their own golden, ``tests/golden/kvpress_zoo.npz``, made
by ``experiments/golden/make_kvpress_zoo.py`` on the same model and passages.

How to run
----------
    pip install -e '.[compare]' kvpress
    python experiments/golden/make_kvpress.py [--gguf PATH] [--out PATH]

Defaults: ``--gguf /root/.cache/kvjax/SmolLM2-135M-Instruct.Q4_1.gguf``,
``--out tests/golden/kvpress_golden.npz``. It runs on 2 CPU threads in a
couple of minutes, most of it loading the GGUF.
"""

from __future__ import annotations

import argparse
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

from experiments.eval.hf_reference import DEFAULT_GGUF, load_hf_reference, save_golden

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "tests" / "golden" / "kvpress_golden.npz"
TEXT_PATH = REPO_ROOT / "experiments" / "data" / "devils_dictionary.txt"

SEED = 0
ATTN = "sdpa"
# (approximate character offset, number of ids); each passage starts just after
# the first paragraph break ("\n\n") at or after the offset.
CONTEXTS = {1: (20000, 640), 2: (40000, 300)}
PASSAGE_CHARS = 4000  # comfortably more than the ids needed
WINDOW = 64
N_SINK = 4
# (context, press name, ratio)
RUNS = [
    (1, "snapkv", 0.25), (1, "snapkv", 0.5), (1, "snapkv", 0.75),
    (1, "streaming_llm", 0.5),
    (1, "knorm", 0.5),
    (1, "tova", 0.5),
    (1, "expected_attention", 0.25), (1, "expected_attention", 0.5), (1, "expected_attention", 0.75),
    (1, "pyramidkv", 0.5),
    (1, "adakv_snapkv", 0.5),
    (2, "snapkv", 0.5), (2, "knorm", 0.5), (2, "expected_attention", 0.5),
]


def make_press(name: str, ratio: float):
    import kvpress

    if name == "snapkv":
        return kvpress.SnapKVPress(compression_ratio=ratio)
    if name == "streaming_llm":
        return kvpress.StreamingLLMPress(compression_ratio=ratio)
    if name == "knorm":
        return kvpress.KnormPress(compression_ratio=ratio)
    if name == "tova":
        return kvpress.TOVAPress(compression_ratio=ratio)
    if name == "expected_attention":
        return kvpress.ExpectedAttentionPress(compression_ratio=ratio)
    if name == "pyramidkv":
        return kvpress.PyramidKVPress(compression_ratio=ratio)
    if name == "adakv_snapkv":
        return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio))
    raise ValueError(name)


def run_press(model, torch, ids: np.ndarray, name: str, ratio: float, n_layers: int, kvh: int):
    """One prefill forward with the press active; returns (keep, scores, budgets, cache_lens)."""
    from kvpress.utils import compute_n_kept
    from transformers import DynamicCache

    press = make_press(name, ratio)
    scorer = press.press if name == "adakv_snapkv" else press
    t = len(ids)
    scores = np.full((n_layers, kvh, t), np.nan, dtype=np.float32)
    keep = np.zeros((n_layers, kvh, t), dtype=bool)
    budgets = np.zeros(n_layers, dtype=np.int64)
    # gap between the smallest kept and the largest evicted score ([L] for AdaKV: over all heads)
    margins = np.full((n_layers,) if name == "adakv_snapkv" else (n_layers, kvh), np.nan, dtype=np.float32)
    stash = {}

    orig_score = scorer.score
    orig_compress = press.compress

    def score(module, hidden_states, keys, values, attentions, kwargs):
        s = orig_score(module, hidden_states, keys, values, attentions, kwargs)
        assert s.shape == (1, kvh, t) and s.dtype == torch.float32, (s.shape, s.dtype)
        stash[module.layer_idx] = s.detach().clone()  # AdaKV scatters into s in place afterwards
        return s

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        layer = module.layer_idx
        assert attentions is None  # sdpa: presses recompute the window attention themselves
        assert keys.shape == (1, kvh, t, module.head_dim), keys.shape
        new_k, new_v = orig_compress(module, hidden_states, keys, values, attentions, kwargs)
        s = stash[layer]
        scores[layer] = s[0].numpy()
        if name == "adakv_snapkv":
            assert new_k is keys and new_v is values  # AdaKV masks, it does not shrink
            b_idx, h_idx, s_idx = (x.numpy() for x in module.masked_key_indices)
            assert (b_idx == 0).all()
            m = np.ones((kvh, t), dtype=bool)
            m[h_idx, s_idx] = False
            keep[layer] = m
            n_kept = compute_n_kept(t, ratio)
            budgets[layer] = kvh * n_kept
            assert len(s_idx) == kvh * (t - n_kept)
            # Re-derive AdaKV's choice from the stashed inner scores (safeguard, then global bottom-k).
            n_safe = max(1, int(n_kept * press.alpha_safeguard))
            s2 = s.clone()
            s2.scatter_(-1, torch.topk(s2, n_safe, dim=-1).indices, torch.finfo(s2.dtype).max)
            flat = s2.reshape(-1)
            pruned = torch.topk(-flat, kvh * (t - n_kept)).indices
            m2 = np.ones(kvh * t, dtype=bool)
            m2[pruned.numpy()] = False
            assert (m2.reshape(kvh, t) == m).all()
            assert (m.sum(-1) >= n_safe).all()
            srt = np.sort(flat.numpy())[::-1]
            margins[layer] = srt[kvh * n_kept - 1] - srt[kvh * n_kept]
        else:
            n_kept = scorer.get_layer_budget(module, t) if name == "pyramidkv" else compute_n_kept(t, ratio)
            budgets[layer] = n_kept
            idx = s.topk(n_kept, dim=-1).indices
            gather = idx.unsqueeze(-1).expand(-1, -1, -1, module.head_dim)
            assert torch.equal(new_k, keys.gather(2, gather)), f"{name} layer {layer}: keys differ"
            assert torch.equal(new_v, values.gather(2, gather)), f"{name} layer {layer}: values differ"
            m = np.zeros((kvh, t), dtype=bool)
            np.put_along_axis(m, idx[0].numpy(), True, axis=-1)
            keep[layer] = m
            srt = np.sort(s[0].numpy(), axis=-1)[:, ::-1]
            margins[layer] = srt[:, n_kept - 1] - srt[:, n_kept] if n_kept < t else np.inf
        return new_k, new_v

    scorer.score = score
    press.compress = compress
    inp = torch.from_numpy(ids.astype(np.int64))[None]
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        out = model(input_ids=inp, past_key_values=cache, use_cache=True)
    cache = out.past_key_values
    cache_lens = np.asarray([cache.layers[i].keys.shape[2] for i in range(n_layers)])
    assert len(stash) == n_layers and not np.isnan(scores).any() and not np.isnan(margins).any()
    return keep, scores, budgets, cache_lens, margins


def check(name: str, ratio: float, keep, scores, budgets, cache_lens, t: int, kvh: int):
    from kvpress.utils import compute_n_kept

    n_kept = compute_n_kept(t, ratio)
    if name == "adakv_snapkv":
        assert (keep.sum(axis=(1, 2)) == kvh * n_kept).all()
        assert (cache_lens == t).all()
        return
    assert (keep.sum(-1) == budgets[:, None]).all()
    assert (cache_lens == budgets).all(), (cache_lens, budgets)
    if name != "pyramidkv":
        assert (budgets == n_kept).all()
    if name == "streaming_llm":
        want = np.zeros(t, dtype=bool)
        want[:N_SINK] = True
        want[t - (n_kept - N_SINK):] = True
        assert (keep == want).all()
    if name in ("snapkv", "pyramidkv"):
        assert keep[..., -WINDOW:].all()
    if name == "expected_attention":
        assert keep[..., :N_SINK].all()
    if name == "tova":
        assert (keep == keep[:, :1]).all() and (scores == scores[:, :1]).all()
        assert keep[..., -1].all()


def describe_ties(name: str, keep, scores, margins) -> str:
    """Which of the tied positions torch's top-k kept, where the boundary is a tie."""
    if name == "adakv_snapkv" or not (margins == 0).any():
        return ""
    how = []
    for layer, head in zip(*np.nonzero(margins == 0)):
        k, s = keep[layer, head], scores[layer, head]
        v = s[k].min()
        tied = np.nonzero(s == v)[0]
        kept = np.nonzero(k[tied])[0]
        lo = kept.tolist() == list(range(len(kept)))
        hi = kept.tolist() == list(range(len(tied) - len(kept), len(tied)))
        how.append(f"L{layer}H{head}:{len(kept)}/{len(tied)} tied kept" + (" (lowest idx)" if lo else "")
                   + (" (highest idx)" if hi else "") + ("" if lo or hi else f" {tied[kept].tolist()} of {tied.tolist()}"))
    return f"\n    boundary ties in {len(how)} (layer, head): " + "; ".join(how)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="path of the SmolLM2 GGUF file")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output .npz path")
    args = ap.parse_args(argv)

    import torch
    import transformers

    import kvpress  # noqa: F401  (patches the attention functions, as kvpress always does)

    model, tok, info = load_hf_reference(args.gguf, dtype=torch.float32, attn_implementation=ATTN, seed=SEED)
    timings = dict(info["timings"])
    gguf_sha, gname = info["gguf_sha256"], info["gguf_name"]
    cfg = model.config
    assert cfg._attn_implementation == ATTN, cfg._attn_implementation
    n_layers, kvh = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = model.model.layers[0].self_attn.head_dim
    rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    print(f"model: {type(model).__name__} L={n_layers} H={cfg.num_attention_heads} KVH={kvh} "
          f"head_dim={head_dim} rope_theta={rope_theta}")

    out: dict[str, np.ndarray] = {}

    # ---- contexts ------------------------------------------------------------
    full = TEXT_PATH.read_text(encoding="utf-8")
    ctx_ids = {}
    for c, (offset, n) in CONTEXTS.items():
        start = full.index("\n\n", offset) + 2
        text = full[start : start + PASSAGE_CHARS]
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        assert len(enc["input_ids"]) >= n, (c, len(enc["input_ids"]))
        ids = np.asarray(enc["input_ids"][:n], dtype=np.int32)
        text = text[: enc["offset_mapping"][n - 1][1]]  # the characters of the first n ids
        again = tok(text, add_special_tokens=False)["input_ids"]
        assert again == ids.tolist(), f"ctx{c}: the truncated text does not re-tokenize to the ids"
        ctx_ids[c] = ids
        out[f"ctx{c}_ids"] = ids
        out[f"ctx{c}_text"] = np.asarray(text)
        out[f"ctx{c}_char_offset"] = np.int32(start)
        print(f"ctx{c}: chars [{start}, {start + len(text)}), {n} ids, starts {tok.decode(ids[:12])!r}")

    # ---- presses -------------------------------------------------------------
    t0 = time.perf_counter()
    for c, name, ratio in RUNS:
        ids = ctx_ids[c]
        t = len(ids)
        t1 = time.perf_counter()
        keep, scores, budgets, cache_lens, margins = run_press(model, torch, ids, name, ratio, n_layers, kvh)
        check(name, ratio, keep, scores, budgets, cache_lens, t, kvh)
        prefix = f"ctx{c}_{name}_r{ratio:.2f}"
        out[f"{prefix}_keep"] = keep
        out[f"{prefix}_scores"] = scores
        out[f"{prefix}_margin"] = margins
        ties = describe_ties(name, keep, scores, margins)
        extra = f" budgets {budgets.tolist()}" if name == "pyramidkv" else ""
        if name == "adakv_snapkv":
            per_head = keep.sum(-1)
            extra = f" per-head kept min {per_head.min()} max {per_head.max()}"
        print(f"{prefix}: kept/layer {int(keep[0].sum(-1).mean())} of {t}, "
              f"min margin {margins.min():.3g}, {time.perf_counter() - t1:.1f}s{extra}{ties}")
    timings["presses"] = time.perf_counter() - t0

    # Scores do not depend on the ratio, and presses that share a scorer agree.
    for c, name, ratio in RUNS:
        ref = out[f"ctx{c}_{name}_r0.50_scores"]
        assert np.array_equal(out[f"ctx{c}_{name}_r{ratio:.2f}_scores"], ref), (c, name, ratio)
    snap = out["ctx1_snapkv_r0.50_scores"]
    assert np.array_equal(out["ctx1_pyramidkv_r0.50_scores"], snap)
    assert np.array_equal(out["ctx1_adakv_snapkv_r0.50_scores"], snap)

    # ---- metadata ------------------------------------------------------------
    out["kvpress_version"] = np.asarray(metadata.version("kvpress"))
    out["transformers_version"] = np.asarray(transformers.__version__)
    out["torch_version"] = np.asarray(torch.__version__)
    out["gguf_sha256"] = np.asarray(gguf_sha)
    out["gguf_name"] = np.asarray(gname)
    out["num_layers"] = np.int32(n_layers)
    out["kv_heads"] = np.int32(kvh)
    out["num_heads"] = np.int32(cfg.num_attention_heads)
    out["head_dim"] = np.int32(head_dim)
    out["rope_theta"] = np.float64(rope_theta)
    out["attn_implementation"] = np.asarray(ATTN)

    save_golden(args.out, out, timings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
