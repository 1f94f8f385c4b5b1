"""Make the golden reference file for the SmolLM2-135M-Instruct port.

What it makes
-------------
``tests/golden/smollm2_golden.npz``: reference token ids and outputs computed by
an implementation that shares no code with kvjax: Hugging Face ``transformers``
+ PyTorch (float32, CPU), loading the same GGUF file kvjax loads
(``SmolLM2-135M-Instruct.Q4_1.gguf``; transformers dequantizes it with the
``gguf`` package and undoes llama.cpp's Q/K row permutation itself; the
loading is ``experiments/eval/hf_reference.py``'s, shared with the other
reference scripts). kvjax's
tests feed the stored token ids to the JAX model and compare its outputs with
the stored ones. The file holds:

* logit check, prompts ``i`` = 0..3 (two plain prose sentences, one
  chat-templated prompt, one with unusual punctuation and unicode):
  ``prompt{i}_text`` (str), ``prompt{i}_ids`` int32 [T],
  ``prompt{i}_argmax`` int32 [T] (argmax of the logits at every position),
  ``prompt{i}_logits_cols`` float32 [T, 1024] (logits at the vocabulary
  columns ``logit_cols``), ``prompt{i}_last_logits`` float32 [V] (all logits
  at the last position); ``logit_cols`` int32 [1024] (a fixed, seeded, sorted
  random subset of the vocabulary).
* perplexity check on the first ~6000 characters of
  ``experiments/data/devils_dictionary.txt``: ``ppl_text``, ``ppl_ids``
  int32 [M=1024], ``ppl_context`` (N=256), ``ppl_stride`` (S=128),
  ``ppl_window_starts``, ``ppl_nll_sum`` float64, ``ppl_tokens_scored``,
  ``ppl_value`` float64, ``ppl_token_nll`` float64 [M-1] (the nll of token t
  is at index t-1). Algorithm: windows of N tokens start at 0, S, 2S, ...
  (the last may be shorter; stop once a window reaches the end of the ids);
  each window scores only the tokens that no earlier window scored, never
  token 0; nll of token t = -log p(ids[t] | the ids of the window before t);
  ppl = exp(nll_sum / tokens_scored). Model in float32, log-softmax and sums
  in float64.
* greedy check: ``greedy_prompt_text``, ``greedy_prompt_ids`` (a user message
  through the chat template with ``add_generation_prompt=True``),
  ``greedy_new_ids`` int32 (the new tokens of
  ``model.generate(do_sample=False, max_new_tokens=32)``, exactly as returned:
  it ends with the EOS id 2 ``<|im_end|>`` if generation stopped there),
  ``greedy_stopped_at_eos`` bool, ``greedy_max_new_tokens``.
* metadata: ``chat_template`` (the template string used), ``eos_token_id``,
  ``transformers_version``, ``torch_version``, ``gguf_sha256``,
  ``gguf_name``, ``attn_implementation``, ``hf_config_json``.

Tokenization. transformers' GGUF tokenizer conversion does not rebuild
SmolLM2's pre-tokenizer exactly (the original splits digits one by one before
the byte-level BPE; the converted one is plain byte-level BPE), so the prompts
here contain no digits, and every token id sequence used is stored: kvjax's
model is tested on these ids, and its own tokenizer is tested separately. The
perplexity text does contain digits; its ids are whatever this tokenizer gives
and the model check only needs ids in, logits out. All text is tokenized with
``add_special_tokens=False``: the converted tokenizer would otherwise prepend
``<|im_start|>`` (id 1) as a BOS token, although the GGUF says
``tokenizer.ggml.add_bos_token = False``.

How to run
----------
    pip install -e '.[compare]'
    python experiments/golden/make_smollm2.py [--gguf PATH] [--out PATH]

Defaults: ``--gguf /root/.cache/kvjax/SmolLM2-135M-Instruct.Q4_1.gguf``,
``--out tests/golden/smollm2_golden.npz``. It runs on 2 CPU threads in about
two minutes (most of it loading: the tokenizer conversion and the
dequantization of the GGUF).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from experiments.eval.hf_reference import DEFAULT_GGUF, load_hf_reference, save_golden

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "tests" / "golden" / "smollm2_golden.npz"
PPL_TEXT_PATH = REPO_ROOT / "experiments" / "data" / "devils_dictionary.txt"

SEED = 0
LOGIT_COLS_SEED = 20240601
N_LOGIT_COLS = 1024
PPL_CHARS = 6000
PPL_M = 1024
PPL_N = 256
PPL_S = 128
GREEDY_MAX_NEW = 32

PLAIN_SHORT = "The old lighthouse keeper climbed the stairs every evening."
PLAIN_LONG = (
    "Long before the railway reached the valley, the villagers carried their "
    "grain over the mountain pass on the backs of patient mules, and every "
    "autumn the whole town gathered at the mill to hear the stones turn and "
    "to trade stories of storms and of the strangers who had passed through."
)
CHAT_USER = "Explain in plain words why the sky looks blue during the day."
UNICODE_TEXT = (
    "«Déjà vu?» — she asked… ¿Qué tal, señor Müller? Ça va! "
    "Tokyo is 東京, Moscow is Москва; π ≈ τ/two → “quotes” & ‘apostrophes’ "
    "(parens) [brackets] {braces} <angle> @#$%^&*_~|\\ naïve café 🙂👍🏽!"
)
GREEDY_USER = "Write one sentence about the sea."


def assert_no_digits(text: str, what: str) -> None:
    bad = sorted({c for c in text if c.isdigit()})
    if bad:
        raise ValueError(f"{what} contains digits {bad!r}; the HF GGUF tokenizer is unreliable on digits")


def encode(tok, text: str) -> np.ndarray:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return np.asarray(ids, dtype=np.int32)


def perplexity(model, torch, ids: np.ndarray, context: int, stride: int):
    """Strided sliding-window perplexity; see the module docstring."""
    m = len(ids)
    token_nll = np.full(m - 1, np.nan, dtype=np.float64)
    starts = []
    scored_until = 1  # token 0 is never scored
    start = 0
    while True:
        end = min(start + context, m)
        starts.append(start)
        window = torch.from_numpy(ids[start:end].astype(np.int64))[None]
        with torch.no_grad():
            logits = model(input_ids=window, use_cache=False).logits[0]  # [W, V] float32
        logp = torch.log_softmax(logits.double(), dim=-1)
        first = max(scored_until, start + 1)
        for t in range(first, end):
            token_nll[t - 1] = -float(logp[t - start - 1, int(ids[t])])
        scored_until = end
        if end >= m:
            break
        start += stride
    assert not np.isnan(token_nll).any()
    nll_sum = float(token_nll.sum())
    n_scored = m - 1
    return {
        "ppl_window_starts": np.asarray(starts, dtype=np.int32),
        "ppl_token_nll": token_nll,
        "ppl_nll_sum": np.float64(nll_sum),
        "ppl_tokens_scored": np.int32(n_scored),
        "ppl_value": np.float64(np.exp(nll_sum / n_scored)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="path of the SmolLM2 GGUF file")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output .npz path")
    args = ap.parse_args(argv)

    import torch
    import transformers

    model, tok, info = load_hf_reference(args.gguf, dtype=torch.float32, seed=SEED)
    timings = dict(info["timings"])
    gguf_sha, gname = info["gguf_sha256"], info["gguf_name"]
    print(model.config)
    print(model.generation_config)
    print("tied lm_head:", model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr())
    print("tokenizer:", type(tok).__name__, "bos", tok.bos_token, "eos", tok.eos_token)

    vocab = model.config.vocab_size
    eos_id = model.generation_config.eos_token_id
    assert tok.convert_ids_to_tokens(eos_id) == "<|im_end|>", tok.convert_ids_to_tokens(eos_id)
    chat_template = tok.chat_template
    assert isinstance(chat_template, str) and chat_template

    out: dict[str, np.ndarray] = {}

    # ---- logit check -------------------------------------------------------
    chat_text = tok.apply_chat_template(
        [{"role": "user", "content": CHAT_USER}], tokenize=False, add_generation_prompt=True
    )
    prompts = [PLAIN_SHORT, PLAIN_LONG, chat_text, UNICODE_TEXT]
    rng = np.random.default_rng(LOGIT_COLS_SEED)
    cols = np.sort(rng.choice(vocab, size=N_LOGIT_COLS, replace=False)).astype(np.int32)
    out["logit_cols"] = cols
    t0 = time.perf_counter()
    for i, text in enumerate(prompts):
        assert_no_digits(text, f"prompt {i}")
        ids = encode(tok, text)
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(ids.astype(np.int64))[None], use_cache=False).logits[0]
        logits = logits.float().numpy()
        print(f"prompt {i}: {len(ids)} tokens, argmax tail {tok.decode(logits.argmax(-1)[-5:])!r}")
        out[f"prompt{i}_text"] = np.asarray(text)
        out[f"prompt{i}_ids"] = ids
        out[f"prompt{i}_argmax"] = logits.argmax(-1).astype(np.int32)
        out[f"prompt{i}_logits_cols"] = logits[:, cols].astype(np.float32)
        out[f"prompt{i}_last_logits"] = logits[-1].astype(np.float32)
    assert 8 <= len(out["prompt0_ids"]) < len(out["prompt1_ids"]) <= 60
    timings["logit_check"] = time.perf_counter() - t0

    # ---- perplexity check --------------------------------------------------
    full = PPL_TEXT_PATH.read_text(encoding="utf-8")
    ppl_text = full[:PPL_CHARS]
    ppl_text = ppl_text[: ppl_text.rfind("\n") + 1]  # end on a line break
    ppl_ids_all = encode(tok, ppl_text)
    assert len(ppl_ids_all) >= PPL_M, len(ppl_ids_all)
    ppl_ids = ppl_ids_all[:PPL_M]
    t0 = time.perf_counter()
    out.update(perplexity(model, torch, ppl_ids, PPL_N, PPL_S))
    timings["perplexity"] = time.perf_counter() - t0
    out["ppl_text"] = np.asarray(ppl_text)
    out["ppl_ids"] = ppl_ids
    out["ppl_context"] = np.int32(PPL_N)
    out["ppl_stride"] = np.int32(PPL_S)
    print(
        f"perplexity: {len(ppl_text)} chars -> {len(ppl_ids_all)} tokens, first {PPL_M} used; "
        f"windows {out['ppl_window_starts'].tolist()}; nll_sum {float(out['ppl_nll_sum']):.6f} over "
        f"{int(out['ppl_tokens_scored'])} tokens; ppl {float(out['ppl_value']):.6f}"
    )

    # ---- greedy check ------------------------------------------------------
    greedy_text = tok.apply_chat_template(
        [{"role": "user", "content": GREEDY_USER}], tokenize=False, add_generation_prompt=True
    )
    assert_no_digits(greedy_text, "greedy prompt")
    gids = encode(tok, greedy_text)
    t0 = time.perf_counter()
    inp = torch.from_numpy(gids.astype(np.int64))[None]
    with torch.no_grad():
        gen = model.generate(
            input_ids=inp,
            attention_mask=torch.ones_like(inp),
            do_sample=False,
            max_new_tokens=GREEDY_MAX_NEW,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
        )
    timings["greedy"] = time.perf_counter() - t0
    new_ids = gen[0, len(gids):].numpy().astype(np.int32)
    # generate stops at the first EOS (batch of one), so EOS can only be last.
    stopped = bool(len(new_ids) > 0 and int(new_ids[-1]) == eos_id)
    # Cross-check generate (KV-cached) against a no-cache forward of the whole sequence.
    with torch.no_grad():
        full_logits = model(input_ids=gen, use_cache=False).logits[0]
    nocache = full_logits.argmax(-1).numpy()[len(gids) - 1 : gen.shape[1] - 1]
    print("greedy: generate == no-cache argmax:", bool((nocache == new_ids).all()))
    out["greedy_prompt_text"] = np.asarray(greedy_text)
    out["greedy_prompt_ids"] = gids
    out["greedy_new_ids"] = new_ids
    out["greedy_stopped_at_eos"] = np.bool_(stopped)
    out["greedy_max_new_tokens"] = np.int32(GREEDY_MAX_NEW)
    print(f"greedy: {len(new_ids)} new tokens, stopped at eos: {stopped}")
    print("greedy text:", repr(tok.decode(new_ids)))

    # ---- metadata ----------------------------------------------------------
    out["chat_template"] = np.asarray(chat_template)
    out["eos_token_id"] = np.int32(eos_id)
    out["transformers_version"] = np.asarray(transformers.__version__)
    out["torch_version"] = np.asarray(torch.__version__)
    out["gguf_sha256"] = np.asarray(gguf_sha)
    out["gguf_name"] = np.asarray(gname)
    out["attn_implementation"] = np.asarray(str(model.config._attn_implementation))
    out["hf_config_json"] = np.asarray(model.config.to_json_string())

    save_golden(args.out, out, timings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
