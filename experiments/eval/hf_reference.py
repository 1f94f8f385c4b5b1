"""Load SmolLM2 from its GGUF file with Hugging Face ``transformers`` + PyTorch.

The reference scripts (``experiments/golden/``: ``make_smollm2.py``, ``make_kvpress.py``,
``crosscheck_quant_torch.py``, ...) compare kvjax with an implementation that
shares no code with it: transformers' own GGUF loader (it dequantizes the
weights with the ``gguf`` package and undoes llama.cpp's Q/K row permutation
itself) and its own tokenizer conversion. They all start the same way, which
lives here:

* ``TQDM_DISABLE=1`` (set when this module is imported, before the scripts
  import torch or transformers) and transformers' progress bars off;
* ``torch.manual_seed(seed)``, ``torch.use_deterministic_algorithms(True)``,
  ``torch.set_num_threads(threads)`` (2 by default: the CPU budget the
  scripts' documented run times assume);
* the GGUF file's sha256 (stored in every golden file's provenance);
* ``AutoTokenizer`` and ``AutoModelForCausalLM`` from the file, in eval mode.

Needs the ``compare`` extra (``pip install -e '.[compare]'``).

Example:
    >>> model, tok, info = load_hf_reference(path, dtype=torch.float32, attn_implementation="sdpa")
    >>> info["gguf_sha256"], info["timings"]["load_model"]
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

# transformers' GGUF dequantization draws a tqdm progress bar; tqdm reads this
# when transformers imports it, so it is set before any script imports them.
os.environ.setdefault("TQDM_DISABLE", "1")

DEFAULT_GGUF = "/root/.cache/kvjax/SmolLM2-135M-Instruct.Q4_1.gguf"


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_hf_reference(gguf_path: str | os.PathLike, *, dtype: Any,
                      attn_implementation: str | None = None, seed: int = 0,
                      threads: int = 2) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, info): transformers' model and tokenizer of a GGUF file.

    Seeds torch, turns on deterministic algorithms and sets `threads` CPU
    threads first (process-wide settings, as the reference scripts want), then
    hashes the file and loads the tokenizer and the model (in eval mode).

    Args:
      gguf_path: the GGUF file (its directory and name are passed to
        ``from_pretrained(dir, gguf_file=name)``).
      dtype: the model's torch dtype (e.g. ``torch.float32``).
      attn_implementation: passed to ``from_pretrained`` when given (e.g.
        ``"sdpa"``, ``"eager"``); None leaves transformers' default.
      seed: for ``torch.manual_seed``.
      threads: for ``torch.set_num_threads``.

    Returns:
      ``info`` holds ``gguf_path`` (resolved, str), ``gguf_name``,
      ``gguf_sha256`` and ``timings``: seconds spent on ``sha256``,
      ``load_tokenizer`` and ``load_model``, in that order.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)

    timings: dict[str, float] = {}
    path = Path(gguf_path).resolve()
    gdir, gname = str(path.parent), path.name

    t0 = time.perf_counter()
    sha = sha256_file(path)
    timings["sha256"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    timings["load_tokenizer"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=dtype, **kwargs)
    model.eval()
    timings["load_model"] = time.perf_counter() - t0

    info = {"gguf_path": str(path), "gguf_name": gname, "gguf_sha256": sha, "timings": timings}
    return model, tok, info


def save_golden(path, arrays: dict, timings: dict, max_bytes: int = 3 * 1024 * 1024) -> None:
    """Write a golden `.npz` (compressed) and say what was written; goldens stay small."""
    import json

    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
    size = path.stat().st_size
    print(f"wrote {path} ({size} bytes, {len(arrays)} arrays)")
    print("timings (s):", json.dumps({k: round(v, 2) for k, v in timings.items()}))
    assert size < max_bytes, f"{path}: {size} bytes, golden files stay under {max_bytes}"
