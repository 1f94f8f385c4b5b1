"""Prefill once, compress many (experiments/eval/cells.py `run_retrieval_group`): the rows of a
grid's methods from one shared context prefill equal one separate cell per method exactly
(outputs, scores, cache bytes, monitor summaries), and the prefill runs once per batch and
prefill group, not once per method. A random-weight tiny model with SmolLM2's vocabulary and
the real tokenizer stands in for the cell's model."""

from __future__ import annotations

from dataclasses import replace

import pytest

import models.sampler as sampler
from experiments.eval import cells as cells_module
from experiments.eval.cells import (Setup, prefill_groups,
                                    run_retrieval_cell, run_retrieval_group, shares_prefill)
from experiments.eval.grid import Cell

METHODS = ["full", "snapkv:ratio=0.5", "streaming_llm:sinks=4,window=16",
           "snapkv:ratio=0.5+kivi:bits=4,group=16", "h2o:ratio=0.5", "tova:ratio=0.5",
           "expected_attention:ratio=0.5"]


@pytest.fixture(scope="module")
def vocab_model():
    from flax import nnx
    from models.llama import Llama, LlamaConfig
    return Llama(LlamaConfig.tiny(vocab_size=49152, max_position=1024), rngs=nnx.Rngs(2))


@pytest.fixture
def tiny_setup(monkeypatch, vocab_model, smollm2_tokenizer):
    from kvjax import Method
    monkeypatch.setattr(cells_module, "_setup", lambda cell: Setup(
        vocab_model, smollm2_tokenizer, Method.parse(cell.method), None))


def _cells(task="niah_single_2"):
    return [Cell(task, 256, m, trials=3, batch=2, max_new_tokens=6) for m in METHODS]


def test_grid_rows_equal_separate_cells_exactly(tiny_setup, monkeypatch):
    cells = _cells()
    alone = [run_retrieval_cell(c) for c in cells]
    widths = []
    prefill = sampler._prefill
    monkeypatch.setattr(sampler, "_prefill", lambda model, tokens, *a: (
        widths.append(tokens.shape), prefill(model, tokens, *a))[1])
    grouped = run_retrieval_group(cells)
    for one, many in zip(alone, grouped):
        assert many["method"] == one["method"]
        for field in ("outputs", "scores", "score", "cache_bytes_per_seq", "monitor"):
            assert many.get(field) == one.get(field), (one["method"], field)
        assert many["prefill_shared_by"] == len(cells) and many["shared_prefill_seconds"] > 0
    context_width = max(w[1] for w in widths)
    # 2 batches (3 trials by 2) x 1 prefill collecting SnapKV's 64 window queries,
    # ExpectedAttention's moments and H2O's attention mass, each method given its own cut
    # (full and StreamingLLM nothing, TOVA the last query, only H2O the mass)
    assert sum(w[1] == context_width for w in widths) == 2, widths


def test_grid_rows_on_a_model_with_sliding_layers_equal_separate_cells(monkeypatch,
                                                                       smollm2_tokenizer):
    """A model whose every other layer slides (its cache holds the window, no method compresses
    it): each method decodes from its own copy of those layers, so the prefill still serves the
    next method (decoding donates its cache; reusing the prefill's window layers failed with
    "Buffer has been deleted or donated") and the rows equal separate cells."""
    from dataclasses import replace as with_fields

    from flax import nnx
    from kvjax import Method
    from models.llama import Llama, LlamaConfig
    config = LlamaConfig.tiny(vocab_size=49152, max_position=1024)
    config = with_fields(config, sliding_window=64, layer_types=tuple(
        "sliding" if i % 2 == 0 else "full" for i in range(config.num_layers)))
    model = Llama(config, rngs=nnx.Rngs(2))
    monkeypatch.setattr(cells_module, "_setup", lambda cell: Setup(
        model, smollm2_tokenizer, Method.parse(cell.method), None))
    cells = [Cell("niah_single_2", 256, m, trials=2, batch=2, max_new_tokens=6)
             for m in ("full", "snapkv:ratio=0.5", "knorm:ratio=0.5")]
    for one, many in zip(map(run_retrieval_cell, cells), run_retrieval_group(cells)):
        assert many["outputs"] == one["outputs"] and many["score"] == one["score"], one["method"]


def test_groups_and_exceptions():
    import kvjax
    transforms = [kvjax.parse_method(m) for m in METHODS]
    groups = prefill_groups(transforms)
    assert [members for _, members in groups] == [list(range(len(METHODS)))]
    assert groups[0][0] == kvjax.StatsSpec(window=64, query_moments=True, moments_skip=4,
                                           attention_mass=True)
    kvzip = kvjax.parse_method("kvzip:ratio=0.5")  # a reconstruction pass: a prefill of its own
    assert [m for _, m in prefill_groups([transforms[0], kvzip])] == [[0], [1]]
    cell = _cells()[0]
    assert shares_prefill(cell)
    assert not shares_prefill(replace(cell, query_aware=True))
    assert not shares_prefill(replace(cell, task="ppl"))
    assert not shares_prefill(replace(cell, engine="kvpress"))
    assert not shares_prefill(replace(cell, warmup=True))
    with pytest.raises(ValueError, match="differ only in method"):
        run_retrieval_group([cell, replace(cell, length=512)])


def test_sweep_units_group_cells_that_share_a_prefill():
    from experiments.eval.harness import _failed, prefill_once_units
    a, b, c = _cells()[:3]
    other_length = replace(a, length=512)
    ppl = Cell("ppl", 256, "full", 2)
    reconstructing = replace(a, method="kvzip:ratio=0.5")  # its own pass after prefill
    aware = replace(b, query_aware=True)
    units = prefill_once_units([a, ppl, b, other_length, reconstructing, aware, c])
    assert units == [(a, b, c), ppl, other_length, reconstructing, aware]
    rows = _failed(units[0], "error: x")
    assert [r["method"] for r in rows] == [a.method, b.method, c.method]
    assert all(r["status"] == "error: x" for r in rows) and _failed(ppl, "s")["task"] == "ppl"


def test_cli_flag_turns_sharing_off():
    from experiments.cli.main import build_parser
    on = build_parser().parse_args(["eval", "--config", "ruler_smoke", "--out", "o"])
    off = build_parser().parse_args(["eval", "--config", "ruler_smoke", "--out", "o",
                                     "--no-shared-prefill"])
    assert (on.no_shared_prefill, off.no_shared_prefill) == (False, True)
