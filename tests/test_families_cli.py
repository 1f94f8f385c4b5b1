"""`kvjax ppl --model DIR` and `kvjax generate --model DIR` on each family's directory give
transformers' numbers.

Each tiny checkpoint (tests/golden/families) gets a `tokenizer.json` in a copy of its
directory: token id i (3-127) is the character U+0100 + i, so a text spells the golden ids
exactly. `kvjax ppl` over the 272 golden tokens (one window) equals the perplexity of
transformers' golden logits (measured within 1e-7 relative; asserted 1e-5), and `kvjax
generate` on the first 200 tokens prints transformers' 32 greedy tokens (up to the first
end token, id 2, where the command stops).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

GOLDEN = Path(__file__).parent / "golden" / "families"
DIRS = ("llama3", "qwen2", "qwen3", "mistral_sw", "gemma3", "phi3", "gemma3_multimodal")


SPECIAL = ("<pad>", "<s>", "</s>")  # ids 0-2


def spell(ids) -> str:
    return "".join(SPECIAL[i] if i < 3 else chr(0x100 + int(i)) for i in ids)


def with_tokenizer(name: str, tmp_path: Path) -> Path:
    """A copy of the family's directory with a one-character-per-id tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models

    d = tmp_path / name
    shutil.copytree(GOLDEN / name, d)
    vocab = {**{t: i for i, t in enumerate(SPECIAL)}, **{chr(0x100 + i): i for i in range(3, 128)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(d / "tokenizer.json"))
    return d


def golden_perplexity(golden) -> float:
    """exp(mean NLL) of tokens 1..T-1 under transformers' golden logits, in float64."""
    logits, ids = golden["logits"][0].astype(np.float64), golden["input_ids"][0]
    top = logits.max(-1, keepdims=True)
    log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return float(np.exp(-log_probs[np.arange(len(ids) - 1), ids[1:]].mean()))


def run_cli(argv, capsys) -> dict:
    from experiments.cli.main import main

    code = main(argv + ["--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out.strip().splitlines()[-1])


@pytest.mark.parametrize("name", DIRS)
def test_cli_ppl_equals_transformers(name, tmp_path, capsys):
    d = with_tokenizer(name, tmp_path)
    golden = np.load(d / "golden.npz")
    text = tmp_path / "text.txt"
    text.write_text(spell(golden["input_ids"][0]), encoding="utf-8")
    result = run_cli(["ppl", "--model", str(d), "--text", str(text), "--context", "272"], capsys)
    assert result["tokens_scored"] == 271
    assert abs(result["ppl"] / golden_perplexity(golden) - 1) <= 1e-5


@pytest.mark.parametrize("name", DIRS[:-1])  # the multimodal golden has no greedy tokens
def test_cli_generate_prints_transformers_greedy_tokens(name, tmp_path, capsys):
    d = with_tokenizer(name, tmp_path)
    golden = np.load(d / "golden.npz")
    prompt = spell(golden["input_ids"][0, :int(golden["prompt_len"])])
    result = run_cli(["generate", "--model", str(d), "--prompt", prompt,
                      "--max-new-tokens", "32"], capsys)
    assert result["prompt_tokens"] == 200
    greedy = golden["greedy"].tolist()
    n = greedy.index(2) + 1 if 2 in greedy else len(greedy)  # the CLI stops at the end token
    assert result["tokens"] == greedy[:n]
    assert result["text"].startswith(spell([i for i in greedy[:n] if i != 2]))
