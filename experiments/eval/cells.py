"""What one harness cell runs on kvjax: a retrieval task, continuation perplexity, or speed.

Each `run_*` function loads the model, does the cell's work and returns one JSON-able
row (the cell's fields, `status="ok"`, a `score` and the task's own measurements).
They run inside the harness's worker processes (experiments/eval/harness.py); the kvpress
side of a comparison is experiments/eval/kvpress_engine.py.

* retrieval (`passkey` and the RULER-style tasks): contexts prefilled and compressed
  by the method, the question appended (query-agnostic), greedy answer; `score` is the
  mean of the per-trial scores (0..1, higher is better). With `query_aware` the question
  is prefilled with the context and compressed with it (SnapKV's window is then the
  question). `haystack` (`haystack_path`) replaces the built-in prose by a text file.
* `ppl`: `trials` whole windows of `length` tokens of KJV Genesis (or the cell's `text_path`
  file); each window's first 3/4 is prefilled and compressed, the last 1/4 is fed on top
  and scored; `score` is the perplexity of those tokens (lower is better).
  `cache_bytes_per_token` is the compressed prefix's bytes per prefix token (the run's
  float32 cache) and `cache_bytes_per_token_bf16` the same cache as bfloat16 would store it
  (`kvjax.nbytes(..., float_dtype=bfloat16)`: float leaves at 2 bytes, codes unchanged), the
  memory axis the tables use: compression against the cache users deploy.
* `memory`: one window of `length` tokens of the same text prefilled into a bfloat16
  cache, compressed and shrunk to what it keeps; `score` is bytes per context token over
  all layers and KV heads, beside `theoretical` (`theoretical_bytes`: the formats alone),
  so an accounting bug shows.
* `speed`: `batch` windows of `length` tokens of real prose; prefill + compression
  and a decode of `max_new_tokens` tokens (end-of-sequence ignored), each timed after
  a compiling run, medians over `trials` repeats; `score` is decode ms per step.

`run_kvjax_cell` picks the cell's `run_*` by task; `experiments.eval.harness.run_cell` picks
the engine.

Example:
    >>> row = run_kvjax_cell(Cell("ppl", 1024, "snapkv:ratio=0.5", trials=8, batch=8))
    >>> row["score"], row["cache_bytes_per_token"]
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NamedTuple

from experiments.eval.grid import Cell

if TYPE_CHECKING:
    from kvjax.core.stats import StatsSpec

DATA = Path(__file__).parents[1] / "data"
PPL_TEXT = DATA / "kjv_genesis.txt"
SPEED_TEXT = DATA / "devils_dictionary.txt"
PPL_PREFIX = 0.75  # fraction of each ppl window that is compressed; the rest is scored
PASSKEY_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


class Prompts(NamedTuple):
    contexts: list[list[int]]  # one per trial: what the method compresses
    questions: list[list[int]]  # one per trial: appended after compression
    score: Callable[[int, str], float]  # (trial index, generated text) -> 0..1
    depths: list[float] | None  # passkey: the needle depth of each trial


def make_prompts(cell: Cell, tokenizer) -> Prompts:
    """The trials of a retrieval cell; passkey depths cycle over PASSKEY_DEPTHS."""
    paths = [cell.haystack_path] if cell.haystack_path else None
    if cell.task == "passkey":
        from experiments.eval.passkey import make_trials, score_trials
        per_depth = -(-cell.trials // len(PASSKEY_DEPTHS))
        trials = make_trials(tokenizer, cell.length, PASSKEY_DEPTHS, per_depth, seed=cell.seed,
                             text_paths=paths)
        # by depth then trial; take round-robin so a cut keeps every depth and each batch
        # of the cell is a fair sample of depths
        order = sorted(range(len(trials)), key=lambda i: (i % per_depth, i // per_depth))
        trials = [trials[i] for i in order][:cell.trials]
        return Prompts([t.context for t in trials], [t.question for t in trials],
                       lambda i, text: float(score_trials([trials[i]], [text])[0]),
                       [t.depth for t in trials])
    from experiments.eval.ruler import make_task_trials, score
    trials = make_task_trials(tokenizer, cell.task, cell.length, cell.trials, seed=cell.seed,
                              text_paths=paths)
    return Prompts([t.context for t in trials], [t.question for t in trials],
                   lambda i, text: score(trials[i], text), None)


class Setup(NamedTuple):
    model: object  # models.llama.Llama, its weights on the cell's mesh when it has one
    tokenizer: object
    method: object  # kvjax.Method: the cell's spec parsed once (its transform pinned to the
    #                 mesh's cache layout when the cell has a mesh)
    place_cache: Callable | None  # puts an empty cache on the mesh (None: one device)


def _setup(cell: Cell) -> Setup:
    """The cell's model, tokenizer, parsed method and cache placement, with the persistent
    compilation cache on. With `cell.mesh` ("data=2,model=4", the config's `[mesh]`) the
    weights, the caches and the transform's output are placed as `kvjax generate --mesh`
    places them (models.sharding: shard_model, cache_placer, on_mesh)."""
    from kvjax import Method
    from models.hub import enable_compilation_cache
    from models.loading import load_model

    enable_compilation_cache()  # cells of one sweep share shapes: compile each once
    model, tokenizer = load_model(cell.model)
    from models.reconstruction import with_tokenizer  # kvzip's prompt: this tokenizer's ids
    method = Method.parse(cell.method)
    method = method.with_transform(with_tokenizer(method.transform, tokenizer))
    if not cell.mesh:
        return Setup(model, tokenizer, method, None)
    from models.sharding import cache_placer, make_mesh, on_mesh, shard_model
    mesh = make_mesh(cell.mesh)
    return Setup(shard_model(model, mesh), tokenizer,
                 method.with_transform(on_mesh(method.transform, mesh)),
                 cache_placer(mesh))


def run_retrieval_cell(cell: Cell) -> dict:
    """Answer the cell's trials in batches of `cell.batch` and score them.

    With `cell.warmup` the first batch runs once untimed first, so `seconds` (and
    `seconds_per_trial`) exclude compilation.
    """
    from kvjax import nbytes
    from models.sampler import generate

    model, tokenizer, method, place_cache = _setup(cell)
    transform = method.transform
    if cell.method != "full":  # the row carries a summary of what the method did
        from kvjax.tools.monitor import monitored
        transform = monitored(transform)
    prompts = make_prompts(cell, tokenizer)
    if cell.query_aware:  # one prompt per trial, compressed whole
        run = lambda b: generate(model, [c + q for c, q in zip(
            prompts.contexts[b:b + cell.batch], prompts.questions[b:b + cell.batch])],
            transform=transform, max_new_tokens=cell.max_new_tokens, place_cache=place_cache)
    else:
        run = lambda b: generate(model, prompts.questions[b:b + cell.batch],
                                 contexts=prompts.contexts[b:b + cell.batch],
                                 transform=transform, max_new_tokens=cell.max_new_tokens,
                                 place_cache=place_cache)
    if cell.warmup:
        run(0)
    texts, cache_bytes, start = [], [], time.perf_counter()
    for b in range(0, cell.trials, cell.batch):
        out = run(b)
        texts += [tokenizer.decode(row[:n].tolist()) for row, n in zip(out.tokens, out.num_tokens)]
        cache_bytes.append(nbytes(out.cache) / len(out.tokens))
    measured = dict(cache_bytes_per_seq=max(cache_bytes))
    if cell.method != "full":  # kvjax.tools.monitor, summed/averaged over the last batch
        from kvjax.tools.monitor import find_monitor, refresh, summary
        measured["monitor"] = summary(refresh(find_monitor(out.transform_state), out.cache))
    return retrieval_row(cell, prompts, texts, time.perf_counter() - start, **measured)


RECONSTRUCTING = ("kvzip", "kvgrad", "restorekv")  # parts that run a pass after prefill (own prefill)


def shares_prefill(cell: Cell) -> bool:
    """True for a cell whose context prefill another method's cell can share: a kvjax
    retrieval cell, query-agnostic, untimed, on one device, compressed after its prefill with
    no model pass of its own (kvzip's, kvgrad's and restorekv's reconstruction runs in their own
    cell)."""
    return (cell.engine == "kvjax" and cell.task not in ("ppl", "speed", "memory")
            and not cell.query_aware and not cell.timed and not cell.mesh
            and not any(part.split(":")[0].strip() in RECONSTRUCTING
                        for part in cell.method.split("+")))


def prefill_groups(transforms: list) -> list[tuple[StatsSpec, list[int]]]:
    """Which of `transforms` share one prefill, and what it collects: (statistics, indices)
    per prefill, each the union of its members' `transform.stats` from which every member's
    own can be cut (`kvjax.core.stats.covering`; `project_stats` and `project_cache` cut them,
    so a monitor or a policy sees only what its own prefill would have made: H2O's attention
    mass is dropped from the others' copies). What only a pass of its own gives (moments
    skipping otherwise, KVzip's reconstruction, a token scorer, chunk windows) keeps a
    prefill apart.

    Example:
        >>> import kvjax
        >>> groups = prefill_groups([kvjax.full(), kvjax.parse_method("snapkv:ratio=0.5"),
        ...                          kvjax.parse_method("h2o:ratio=0.5"),
        ...                          kvjax.parse_method("expected_attention:ratio=0.5")])
        >>> [(spec.window, spec.query_moments, spec.attention_mass, members)
        ...  for spec, members in groups]
        [(64, True, True, [0, 1, 2, 3])]
    """
    from kvjax.core.stats import can_project, covering
    groups: list[tuple[StatsSpec, list[int]]] = []
    for i, transform in enumerate(transforms):
        for g, (collected, members) in enumerate(groups):
            union = covering(collected, transform.stats)
            if union is not None and all(can_project(union, transforms[j].stats)
                                         for j in members):
                groups[g] = (union, members + [i])
                break
        else:
            groups.append((transform.stats, [i]))
    return groups


def run_retrieval_group(cells: list[Cell]) -> list[dict]:
    """The rows of retrieval cells that differ only in method, each context prefilled once.

    Per batch of trials, the contexts are prefilled once per `prefill_groups` group (the
    union of what its methods' statistics need: full, SnapKV, TOVA, ExpectedAttention, H2O
    and `auto` one), and each method compresses a copy (`compress(..., keep_input=True)`)
    with its own statistics and cache cut from the union's, then
    its questions are appended and answered as `run_retrieval_cell` does: the same tokens,
    scores and monitor summaries as one cell per method (tests/test_prefill_once.py). A row's
    `seconds` is its own compression and decoding plus an equal share of the prefills
    (`shared_prefill_seconds`, the group's prefill time, and `prefill_shared_by` beside it).
    """
    from kvjax import Method, nbytes
    from kvjax.core.stats import project_cache, project_stats
    from models.sampler import (_padded_width, compress, decode, extend, for_full_layers,
                                keep_window_layers, prefill_batch)

    base = cells[0]
    if any(replace(c, method=base.method) != base for c in cells) or \
            not all(map(shares_prefill, cells)):
        raise ValueError("run_retrieval_group: cells must be kvjax retrieval cells that differ "
                         "only in method (shares_prefill)")
    model, tokenizer, _, place_cache = _setup(base)
    transforms = []  # as decoding takes them; compressing takes them on the full layers
    for cell in cells:
        transform = Method.parse(cell.method).transform
        if cell.method != "full":
            from kvjax.tools.monitor import monitored
            transform = monitored(transform)
        transforms.append(transform)
    on_full_layers = [for_full_layers(model, t) for t in transforms]
    prompts = make_prompts(base, tokenizer)
    groups = prefill_groups(on_full_layers)
    texts = [[] for _ in cells]
    cache_bytes = [[] for _ in cells]
    seconds, monitors = [0.0] * len(cells), [None] * len(cells)
    prefill_s = 0.0
    last_batch = (base.trials - 1) // base.batch * base.batch
    for b in range(0, base.trials, base.batch):
        contexts = prompts.contexts[b:b + base.batch]
        questions = prompts.questions[b:b + base.batch]
        suffix_room = _padded_width(questions, 256)
        room = suffix_room + base.max_new_tokens
        for collected, members in groups:
            start = time.perf_counter()
            pre = prefill_batch(model, contexts, stats=collected, room=room,
                                place_cache=place_cache)
            jax_block(pre.cache)
            prefill_s += time.perf_counter() - start
            for i in members:
                start = time.perf_counter()
                spec = on_full_layers[i].stats
                own = pre._replace(cache=project_cache(pre.cache, collected, spec),
                                   stats=project_stats(pre.stats, collected, spec))
                out = compress(own, on_full_layers[i], room=room, keep_input=True,
                               max_write=max(suffix_room, 1))
                # the window layers copied: decoding donates them, the prefill serves on
                out = out._replace(cache=keep_window_layers(model, out.cache, own.cache,
                                                            copy=True))
                out = extend(model, out, questions, transform=transforms[i])
                gen = decode(model, out, max_new_tokens=base.max_new_tokens,
                             transform=transforms[i])
                seconds[i] += time.perf_counter() - start
                texts[i] += [tokenizer.decode(row[:n].tolist())
                             for row, n in zip(gen.tokens, gen.num_tokens)]
                cache_bytes[i].append(nbytes(gen.cache) / len(gen.tokens))
                if b == last_batch and cells[i].method != "full":
                    from kvjax.tools.monitor import find_monitor, refresh, summary
                    # summarized now: holding every method's last cache until the end took
                    # one cache per method (a 4k x 5 grid group passed 12 GB)
                    monitors[i] = summary(refresh(find_monitor(gen.transform_state), gen.cache))
                del out, gen
            del pre  # before the next group's prefill: one prefilled cache at a time
    rows = []
    for i, cell in enumerate(cells):
        measured = dict(cache_bytes_per_seq=max(cache_bytes[i]))
        if monitors[i] is not None:
            measured["monitor"] = monitors[i]
        share = prefill_s / len(cells)
        rows.append(retrieval_row(cell, prompts, texts[i], seconds[i] + share,
                                  shared_prefill_seconds=round(prefill_s, 2),
                                  prefill_shared_by=len(cells), **measured))
    return rows


def jax_block(tree) -> None:
    """Wait for every array of `tree` (so a timing covers the work, not its dispatch)."""
    import jax
    jax.block_until_ready(tree)


def retrieval_row(cell: Cell, prompts: Prompts, texts: list[str], seconds: float,
                  **measured) -> dict:
    """The result row of a retrieval cell (either engine): scores, outputs, seconds, depths."""
    scores = [prompts.score(i, text) for i, text in enumerate(texts)]
    row = dict(asdict(cell), status="ok", score=sum(scores) / len(scores), scores=scores,
               outputs=texts, seconds=round(seconds, 2),
               seconds_per_trial=round(seconds / cell.trials, 3), **measured)
    if prompts.depths is not None:
        row["depths"] = prompts.depths
    return row


def run_ppl_cell(cell: Cell) -> dict:
    """Continuation perplexity of `cell.trials` windows under the method (see module doc)."""
    import jax.numpy as jnp
    import numpy as np

    import kvjax
    from experiments.eval.ppl import window_ids
    from models.sampler import prefill_and_compress
    from models.scoring import score_continuations

    model, tokenizer, method, place_cache = _setup(cell)
    prefix = int(cell.length * PPL_PREFIX)
    text = text_of(cell)
    windows = window_ids(tokenizer, text, cell.length, cell.trials)
    nll, scored, kept_bytes, kept_bf16, start = 0.0, 0, 0, 0, time.perf_counter()
    for b in range(0, len(windows), cell.batch):
        group = windows[b:b + cell.batch]
        conts = [w[prefix:] for w in group]
        pre = prefill_and_compress(model, [w[:prefix] for w in group],
                                   transform=method.transform,
                                   room=len(conts[0]), place_cache=place_cache)
        kept = kvjax.shrink(pre.cache, 0)  # the prefix's cache, no room
        kept_bytes += kvjax.nbytes(kept)
        kept_bf16 += kvjax.nbytes(kept, float_dtype=jnp.bfloat16)
        for lp in score_continuations(model, pre, conts):
            nll -= float(np.sum(lp, dtype=np.float64))
            scored += len(lp)
    if not np.isfinite(nll):  # a NaN is a failed cell, never a score in the tables
        raise FloatingPointError(f"the summed NLL of {scored} tokens is {nll}")
    return dict(asdict(cell), status="ok", score=float(np.exp(nll / scored)), nll=nll,
                tokens_scored=scored, prefix=prefix, text=text.name,
                cache_bytes_per_token=kept_bytes / (len(windows) * prefix),
                cache_bytes_per_token_bf16=kept_bf16 / (len(windows) * prefix),
                seconds=round(time.perf_counter() - start, 2), **_plan_fields(cell, model))


def _plan_fields(cell: Cell, model) -> dict:
    """{"plan": ...} for an `auto` method (its bits and token shares per layer and the
    damage table's source, `experiments.eval.planner_view.plan_summary`), else {}."""
    from experiments.eval.planner_view import plan_summary
    plan = plan_summary(cell.method, model)
    return {} if plan is None else {"plan": plan}


def text_of(cell: Cell) -> Path:
    """The plain text a ppl or memory cell reads: its `text_path`, else KJV Genesis."""
    return Path(cell.text_path) if cell.text_path else PPL_TEXT


def run_memory_cell(cell: Cell) -> dict:
    """Bytes per context token of one `cell.length`-token window in a bfloat16 cache,
    compressed and shrunk to what the method keeps (`room=0`), beside `theoretical_bytes`."""
    import jax.numpy as jnp

    import kvjax
    from experiments.eval.ppl import window_ids
    from models.sampler import compress, prefill_batch

    model, tokenizer, method, place_cache = _setup(cell)
    text = text_of(cell)
    (ids,) = window_ids(tokenizer, text, cell.length, 1)
    start = time.perf_counter()
    pre = prefill_batch(model, [ids], stats=method.transform.stats, cache_dtype=jnp.bfloat16,
                        place_cache=place_cache)
    rec = method.transform.stats.reconstruction
    if rec is not None:  # kvzip, kvgrad: their pass over the prefilled cache, as the sampler's
        from models.reconstruction import reconstruct
        pre = pre._replace(stats=reconstruct(model, pre.cache, pre.stats, pre.next_pos, [ids],
                                             rec))
    small = pre if cell.method == "full" else compress(pre, method.transform, room=0)
    measured = kvjax.nbytes(small.cache) / cell.length
    cfg = model.config
    return dict(asdict(cell), status="ok", score=measured, bytes_per_token=measured,
                theoretical=theoretical_bytes(cell.method, cell.length, cfg.num_layers,
                                              cfg.num_kv_heads, cfg.head_dim),
                text=text.name, seconds=round(time.perf_counter() - start, 2))


def theoretical_bytes(method: str, n: int, layers: int = 30, kv_heads: int = 3,
                      d: int = 64) -> float:
    """Bytes per context token of `method` on `n` tokens, from the formats alone (bfloat16
    dense parts, float16 quantization parameters), over all layers and KV heads.

    Per token, layer and KV head: keys and values, plus a 4-byte position. An eviction
    part keeps `floor(n * (1 - ratio))` tokens (`budget=`: that many); H2O adds a float32
    attention mass per slot. Per-token b-bit codes: `d*b/8` bytes per key or value plus
    scale and offset per `group` channels; per-channel codes (KIVI keys, `axis=channel`):
    `d*b/8` plus a 2-byte group id plus scale and offset per channel and `group` tokens,
    with the newest `residual .. residual + group - 1` tokens dense. Per-layer constants
    (cursors, the spare table row, low-rank bases) are left out.

    Example:
        >>> theoretical_bytes("full", 4096)                  # 30 x 3 x (2 x 64 x 2 + 4)
        23400.0
        >>> theoretical_bytes("quantize:bits=4,group=32", 4096) / 23400
        0.3230769230769231
    """
    from kvjax.policies.methods import split_part

    parts = [split_part(p) for p in method.split("+") if p.strip()]
    kept, mass, codec = n, 0, ("full", {})
    for name, args in parts:
        if "ratio" in args:
            kept = int(math.floor(n * (1 - float(args["ratio"]))))
        elif "budget" in args:
            kept = min(n, int(args["budget"]))
        if name == "h2o":
            mass = 4
        if name in ("fp8", "quantize", "kivi", "low_rank"):
            codec = (name, args)
    name, args = codec
    dense = 2 * d * 2 + 4 + mass
    exact = 0
    if name == "full":
        per = dense
    elif name == "fp8":
        per = 2 * d + 4 + mass
    elif name == "low_rank":
        rank = int(args["rank"])
        per = (int(args.get("key_rank", rank)) + int(args.get("value_rank", rank))) * 2 + 4 + mass
    else:
        bits = int(args.get("bits", 2 if name == "kivi" else 4))
        group = int(args.get("group", 32))
        params = (1 if args.get("symmetric", False) else 2) * 2 * d / group  # fp16 per group
        token = d * bits / 8 + params
        if name == "kivi" or args.get("axis", "token") == "channel":
            channel = d * bits / 8 + 2 + params  # + the 2-byte group id
            per = channel + (channel if name == "quantize" else token) + 4 + mass
            residual = int(args.get("residual", 128 if name == "kivi" else 0))
            exact = kept - max(0, (kept - residual) // group) * group
        else:
            per = 2 * token + 4 + mass
            exact = min(kept, int(args.get("residual", 0)))
    return ((kept - exact) * per + exact * dense) * layers * kv_heads / n


def run_speed_cell(cell: Cell) -> dict:
    """Prefill(+compress) throughput, decode ms/step, cache bytes and the bandwidth floor."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import kvjax
    from experiments.eval.floor import read_bandwidth_gbs
    from experiments.eval.ppl import window_ids
    from models.sampler import decode, prefill_and_compress

    model, tokenizer, method, place_cache = _setup(cell)
    contexts = window_ids(tokenizer, SPEED_TEXT, cell.length, cell.batch)
    new = cell.max_new_tokens

    def timed(fn):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        return time.perf_counter() - start, out

    def run_prefill():
        return prefill_and_compress(model, contexts, transform=method.transform, room=new,
                                    max_write=1, place_cache=place_cache)

    def run_decode(pre):  # the cache is donated: decode a fresh copy each time
        return timed(lambda: decode(model, pre._replace(cache=jax.tree.map(jnp.copy, pre.cache)),
                                    max_new_tokens=new, transform=method.transform,
                                    eos_ids=()).tokens)

    first_prefill_s, pre = timed(run_prefill)  # compiles
    prefill_s = statistics.median(timed(run_prefill)[0] for _ in range(cell.trials))
    first_decode_s, _ = run_decode(pre)  # compiles
    decode_s = statistics.median(run_decode(pre)[0] for _ in range(cell.trials))
    cache_bytes = kvjax.nbytes(pre.cache)
    weight_bytes = kvjax.nbytes(nnx.state(model, nnx.Param))
    bandwidth = read_bandwidth_gbs()
    decode_ms = 1e3 * decode_s / (new - 1)  # new - 1 forward steps after the prefill's logits
    return dict(asdict(cell), status="ok", score=decode_ms, decode_ms=decode_ms,
                prefill_tok_s=cell.batch * cell.length / prefill_s,
                cache_bytes_per_seq=cache_bytes / cell.batch,
                floor_ms=1e3 * (weight_bytes + cache_bytes) / (bandwidth * 1e9),
                bandwidth_gbs=bandwidth,
                # first call minus warm median: compilation (0 when the persistent cache had it)
                compile_s=max(first_prefill_s - prefill_s, 0.0) + max(first_decode_s - decode_s, 0.0))


def run_kvjax_cell(cell: Cell) -> dict:
    """The cell's row on kvjax, by task (the engine is picked by `harness.run_cell`)."""
    if cell.engine != "kvjax":
        raise ValueError(f"run_kvjax_cell runs engine 'kvjax' cells, not {cell.engine!r}")
    if cell.task == "ppl":
        return run_ppl_cell(cell)
    if cell.task == "speed":
        return run_speed_cell(cell)
    if cell.task == "memory":
        return run_memory_cell(cell)
    return run_retrieval_cell(cell)
