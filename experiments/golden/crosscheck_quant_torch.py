"""Make the float64 reference for kvjax's KV-cache quantization (KIVI and per-channel).

What it makes
-------------
``tests/golden/quant_crosscheck.json``: continuation perplexities of the real
SmolLM2-135M-Instruct with its prefix's KV cache quantized, computed by an
implementation that shares no code with kvjax: Hugging Face ``transformers``
+ PyTorch in float64 (CPU, ``attn_implementation="eager"``) loading the same
GGUF file (``experiments/eval/hf_reference.py``), with the cache quantized by a
numpy float64 simulation written here from the scheme's description, not
from kvjax's code. ``tests/test_quant_crosscheck.py`` computes the same
numbers with kvjax (float32) and compares.

Protocol (kvjax's continuation perplexity, ``experiments/eval/ppl.py`` with
``--context 1024 --prefix 768``): ``experiments/data/kjv_genesis.txt`` is
tokenized with kvjax's own tokenizer (``models.tokenizer.load_tokenizer`` on
the GGUF; no BOS) and cut into consecutive windows of 1024 ids from the
start; the first ``N_WINDOWS`` are used. In each window the prefix (first
768 ids) is run through the model into a ``DynamicCache``; the cache's keys
(after RoPE, as cached) and values are fake-quantized (quantized and
dequantized) in place; the 256 continuation ids are then fed on top of the
cache in one forward pass (they attend to each other exactly: only the
prefix's cache is quantized). Continuation id 0 is scored from the prefix's
last logits, id j > 0 from the continuation's logits at j - 1: 256 scored per
window, nll = -log_softmax in float64; ppl = exp(sum nll / count) over all
windows.

Quantization (per layer and KV head; n = 768 prefix tokens):

* ``kivi:bits=B`` (group G=32, residual R=128, float16 parameters): the oldest
  m = max(0, floor((n - R) / G)) * G tokens (here 640) are quantized, the rest
  stay exact. Keys per channel over groups of G consecutive tokens (one
  scale/offset per (token group, channel)); values per token over groups of G
  consecutive channels.
* ``quantize:bits=4,group=32,axis=channel``: keys and values both per
  channel over groups of 32 tokens, no residual: m = floor(n / G) * G (all 768).
* asymmetric uniform: offset = group min rounded down to float16 (toward
  -inf), scale = (max - offset) / (2**B - 1) rounded up to float16 (toward
  +inf), both saturating at +-65504; code = clip(round_half_even((x - offset)
  / scale), 0, 2**B - 1) (a zero scale divides by 1); x_hat = code * scale +
  offset.

Float64 throughout. transformers' Llama keeps three float32 islands even in
a float64 model: ``LlamaRMSNorm`` casts to float32, the rotary embedding
computes its angles in float32, and eager attention's softmax runs in
float32. ``force_float64`` replaces those three (on this model only, checked
to run) so the reference really is float64; kvjax runs in float32, so the
test's tolerance covers float32 rounding (and the quantization codes it
flips).

The file holds: ``windows`` (the ids, list of lists), ``window``, ``prefix``,
``text``, ``methods``: per method spec (kvjax's ``parse_method`` syntax)
``nll_sum`` and ``tokens`` per window, ``ppl`` (overall), ``quantized_tokens``
(m) and ``token_nll`` (per window, 256 floats); ``near_misses``: the same for
deliberately wrong variants of the schemes (documentation of how far a
plausible bug moves the perplexity; the test checks its tolerance is smaller);
``provenance``: GGUF sha256 and name, torch and transformers versions, dtype.

How to run
----------
    pip install -e '.[compare]'
    python experiments/golden/crosscheck_quant_torch.py [--gguf PATH] [--out PATH]

Defaults: ``--gguf /root/.cache/kvjax/SmolLM2-135M-Instruct.Q4_1.gguf``,
``--out tests/golden/quant_crosscheck.json``. It runs on 2 CPU threads in
about 9 minutes: loading takes one, then each window runs its prefix once and
13 continuations (4 methods, 9 near misses) in float64, eager attention.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import time
import types
from pathlib import Path

import numpy as np

from experiments.eval.hf_reference import DEFAULT_GGUF, load_hf_reference

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "tests" / "golden" / "quant_crosscheck.json"
TEXT_PATH = REPO_ROOT / "experiments" / "data" / "kjv_genesis.txt"

SEED = 0
WINDOW = 1024
PREFIX = 768
N_WINDOWS = 2
F16_MAX = 65504.0

# name -> (keys scheme, values scheme, residual, group); a scheme is
# (bits, axis, param rounding) with axis "channel" (groups of tokens) or "token"
# (groups of channels), param rounding "outward" (the specified scheme),
# "nearest" or "none" (parameters kept in float64).
METHODS = {
    "full": None,
    "kivi:bits=4": ((4, "channel", "outward"), (4, "token", "outward"), 128, 32),
    "kivi:bits=2": ((2, "channel", "outward"), (2, "token", "outward"), 128, 32),
    "quantize:bits=4,group=32,axis=channel": ((4, "channel", "outward"), (4, "channel", "outward"), 0, 32),
}
# Plausible bugs, each one change away from a method above.
NEAR_MISSES = {
    "kivi:bits=2 with values per channel": ((2, "channel", "outward"), (2, "channel", "outward"), 128, 32),
    "kivi:bits=2 with keys per token": ((2, "token", "outward"), (2, "token", "outward"), 128, 32),
    "kivi:bits=2 with residual 96": ((2, "channel", "outward"), (2, "token", "outward"), 96, 32),
    "kivi:bits=2 with residual 160": ((2, "channel", "outward"), (2, "token", "outward"), 160, 32),
    "kivi:bits=2 with float16 params rounded to nearest": ((2, "channel", "nearest"), (2, "token", "nearest"), 128, 32),
    "kivi:bits=2 with float64 params": ((2, "channel", "none"), (2, "token", "none"), 128, 32),
    "kivi:bits=4 with group 64": ((4, "channel", "outward"), (4, "token", "outward"), 128, 64),
    "kivi:bits=4 with 3 bits": ((3, "channel", "outward"), (3, "token", "outward"), 128, 32),
    "quantize:bits=4,group=32,axis=channel with values per token":
        ((4, "channel", "outward"), (4, "token", "outward"), 0, 32),
}


# ---------------------------------------------------------------- quantization (float64 numpy)


def f16_grid(x: np.ndarray, direction: str) -> np.ndarray:
    """x (float64) on the float16 grid: "down" (largest float16 <= x), "up" or "nearest".

    Saturates at +-65504. A float16 has 11 significant bits: for |x| in
    [2**(e-1), 2**e) the spacing is 2**(e-11), and never below the subnormal
    spacing 2**-24; dividing and multiplying by a power of two is exact in float64.
    """
    x = np.clip(np.asarray(x, np.float64), -F16_MAX, F16_MAX)
    if direction == "nearest":
        return x.astype(np.float16).astype(np.float64)
    _, e = np.frexp(x)
    spacing = np.ldexp(1.0, np.maximum(e - 11, -24))
    f = np.floor if direction == "down" else np.ceil
    return f(x / spacing) * spacing


def fake_quantize(x: np.ndarray, bits: int, group: int, reduce_axis: int, params: str) -> np.ndarray:
    """Quantize and dequantize groups of x; `reduce_axis` of the grouped array is the group's.

    x is already reshaped so that one axis runs over the `group` elements
    sharing a scale and offset.
    """
    assert x.shape[reduce_axis] == group
    levels = 2 ** bits - 1
    lo = x.min(axis=reduce_axis, keepdims=True)
    hi = x.max(axis=reduce_axis, keepdims=True)
    if params == "outward":
        offset = f16_grid(lo, "down")
        scale = f16_grid((hi - offset) / levels, "up")
    elif params == "nearest":
        offset = f16_grid(lo, "nearest")
        scale = f16_grid((hi - offset) / levels, "nearest")
    else:
        offset, scale = lo, (hi - lo) / levels
    code = np.clip(np.round((x - offset) / np.where(scale == 0, 1.0, scale)), 0, levels)
    return code * scale + offset


def quantize_oldest(t: np.ndarray, m: int, bits: int, axis: str, group: int, params: str) -> np.ndarray:
    """t [B, KVH, T, D] float64 with its first m tokens fake-quantized.

    axis "channel": each channel over groups of `group` consecutive tokens;
    "token": each token over groups of `group` consecutive channels.
    """
    out = t.copy()
    if m == 0:
        return out
    b, h, _, d = t.shape
    old = t[:, :, :m]
    if axis == "channel":
        g = old.reshape(b, h, m // group, group, d)  # axis 3 = tokens of a group
        out[:, :, :m] = fake_quantize(g, bits, group, 3, params).reshape(b, h, m, d)
    else:
        g = old.reshape(b, h, m, d // group, group)  # axis 4 = channels of a group
        out[:, :, :m] = fake_quantize(g, bits, group, 4, params).reshape(b, h, m, d)
    return out


def quantized_tokens(n: int, residual: int, group: int) -> int:
    """How many of the oldest of n cached tokens are quantized."""
    return max(0, (n - residual) // group) * group


# ---------------------------------------------------------------- float64 transformers


def force_float64(model, torch) -> dict[str, int]:
    """Replace the float32 islands of transformers' Llama by float64 code (see the docstring).

    Returns call counters of the replacements, for the caller to check they ran.
    """
    from transformers.models.llama import modeling_llama as ml

    calls = {"rmsnorm": 0, "rope": 0, "attention": 0}

    def rms_forward(self, h):
        calls["rmsnorm"] += 1
        var = h.pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(var + self.variance_epsilon))

    norms = [m for m in model.modules() if isinstance(m, ml.LlamaRMSNorm)]
    assert len(norms) == 2 * model.config.num_hidden_layers + 1, len(norms)
    for m in norms:
        m.forward = types.MethodType(rms_forward, m)

    rot = model.model.rotary_emb
    assert rot.rope_type == "default" and rot.attention_scaling == 1.0, (rot.rope_type, rot.attention_scaling)
    cfg = model.config
    base = cfg.rope_parameters["rope_theta"]
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)

    def rope_forward(self, x, position_ids):
        calls["rope"] += 1
        freqs = position_ids.to(torch.float64)[:, :, None] * inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    rot.forward = types.MethodType(rope_forward, rot)

    def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        calls["attention"] += 1
        k = ml.repeat_kv(key, module.num_key_value_groups)
        v = ml.repeat_kv(value, module.num_key_value_groups)
        w = torch.matmul(query, k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = torch.softmax(w, dim=-1)  # in the scores' dtype
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w

    # LlamaAttention looks the global up on every call when the implementation is "eager".
    assert model.config._attn_implementation == "eager"
    ml.eager_attention_forward = eager_attention_forward
    return calls


def quantize_cache(cache, spec, n: int, torch) -> int:
    """Fake-quantize a DynamicCache's keys and values in place; returns m."""
    (kb, kaxis, kparams), (vb, vaxis, vparams), residual, group = spec
    m = quantized_tokens(n, residual, group)
    for layer in cache.layers:  # transformers 5: DynamicLayer.keys / .values [B, KVH, T, D]
        assert layer.keys.shape[2] == n and layer.keys.dtype == torch.float64
        k = quantize_oldest(layer.keys.numpy(), m, kb, kaxis, group, kparams)
        v = quantize_oldest(layer.values.numpy(), m, vb, vaxis, group, vparams)
        layer.keys, layer.values = torch.from_numpy(k), torch.from_numpy(v)
    return m


def score_window(model, torch, ids: np.ndarray, specs: dict) -> dict[str, tuple[np.ndarray, int]]:
    """Per spec: (nll of the WINDOW - PREFIX continuation ids [float64], m)."""
    from transformers import DynamicCache

    pre = torch.from_numpy(ids[:PREFIX].astype(np.int64))[None]
    cont_ids = ids[PREFIX:].astype(np.int64)
    cont = torch.from_numpy(cont_ids)[None]
    with torch.no_grad():
        out = model(input_ids=pre, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
    first = torch.log_softmax(out.logits[0, -1], dim=-1)  # float64: predicts cont[0]
    prefix_cache = out.past_key_values
    res = {}
    for name, spec in specs.items():
        cache = copy.deepcopy(prefix_cache)
        m = 0 if spec is None else quantize_cache(cache, spec, PREFIX, torch)
        with torch.no_grad():
            logits = model(input_ids=cont, past_key_values=cache, use_cache=True).logits[0]
        assert logits.dtype == torch.float64 and cache.layers[0].keys.shape[2] == WINDOW
        logp = torch.log_softmax(logits, dim=-1).numpy()
        nll = np.empty(len(cont_ids), np.float64)
        nll[0] = -float(first[cont_ids[0]])
        nll[1:] = -logp[np.arange(len(cont_ids) - 1), cont_ids[1:]]
        res[name] = (nll, m)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="path of the SmolLM2 GGUF file")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output .json path")
    args = ap.parse_args(argv)

    import torch
    import transformers

    from models.tokenizer import load_tokenizer

    model, _, info = load_hf_reference(args.gguf, dtype=torch.float64, attn_implementation="eager", seed=SEED)
    timings = dict(info["timings"])
    assert next(model.parameters()).dtype == torch.float64
    calls = force_float64(model, torch)

    t0 = time.perf_counter()
    tok = load_tokenizer(info["gguf_path"])  # kvjax's tokenizer: the ids kvjax is tested on
    ids = np.asarray(tok.encode(TEXT_PATH.read_text(encoding="utf-8")), np.int64)
    timings["kvjax_tokenize"] = time.perf_counter() - t0
    assert len(ids) >= N_WINDOWS * WINDOW, len(ids)
    windows = [ids[WINDOW * w: WINDOW * (w + 1)] for w in range(N_WINDOWS)]

    specs = {**METHODS, **NEAR_MISSES}
    per_window = []
    t0 = time.perf_counter()
    for w, win in enumerate(windows):
        t1 = time.perf_counter()
        per_window.append(score_window(model, torch, win, specs))
        print(f"window {w}: {time.perf_counter() - t1:.1f}s")
    timings["score"] = time.perf_counter() - t0
    assert calls["rmsnorm"] and calls["rope"] and calls["attention"], calls

    def summary(name):
        nlls = [pw[name][0] for pw in per_window]
        ms = {pw[name][1] for pw in per_window}
        assert len(ms) == 1
        total = float(sum(n.sum() for n in nlls))
        count = sum(len(n) for n in nlls)
        return {"nll_sum": [float(n.sum()) for n in nlls], "tokens": [len(n) for n in nlls],
                "ppl": float(np.exp(total / count)), "quantized_tokens": ms.pop(),
                "token_nll": [n.tolist() for n in nlls]}

    methods = {name: summary(name) for name in METHODS}
    near = {name: summary(name) for name in NEAR_MISSES}
    for d in near.values():
        del d["token_nll"]
    full_ppl = methods["full"]["ppl"]
    print(f"\n{'method':58s} {'m':>4s} {'ppl':>10s} {'vs full':>9s}")
    for group, rows in (("", methods), ("near miss: ", near)):
        for name, d in rows.items():
            print(f"{group + name:58s} {d['quantized_tokens']:4d} {d['ppl']:10.5f} "
                  f"{d['ppl'] / full_ppl - 1:+9.2%}")

    out = {
        "description": "Continuation perplexity with the prefix's KV cache fake-quantized, "
                       "transformers + torch float64 and a numpy float64 quantizer; made by "
                       "experiments/golden/crosscheck_quant_torch.py (see its docstring).",
        "text": str(TEXT_PATH.relative_to(REPO_ROOT)),
        "window": WINDOW,
        "prefix": PREFIX,
        "windows": [win.tolist() for win in windows],
        "methods": methods,
        "near_misses": near,
        "provenance": {
            "gguf_sha256": info["gguf_sha256"],
            "gguf_name": info["gguf_name"],
            "torch_version": torch.__version__,
            "transformers_version": transformers.__version__,
            "dtype": "float64",
            "attn_implementation": "eager",
            "float64_patches": "RMSNorm, rotary angles and eager softmax recomputed in float64",
        },
    }
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(out, indent=1)
    # one line per list of numbers
    text = re.sub(r"\[([-+0-9.e,\s]*)\]", lambda mo: "[" + re.sub(r"\s+", " ", mo.group(1)).strip() + "]", text)
    out_path.write_text(text + "\n", encoding="utf-8")
    print(f"\nwrote {out_path} ({out_path.stat().st_size} bytes)")
    print("timings (s):", json.dumps({k: round(v, 2) for k, v in timings.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
