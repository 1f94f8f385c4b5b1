"""Every paged attention kernel variant compiles with the real TPU compiler (Mosaic), deviceless.

libtpu on this CPU host describes a v5e / v6e slice (`kernels_pallas.tpu_compile`, through
`jax.experimental.topologies.get_topology_desc`);
`jax.jit(f).lower(...).compile()` then runs XLA:TPU and Mosaic's layout passes
exactly as on the chip, so a kernel Mosaic rejects fails here. Nothing runs
on a TPU: this proves the kernels compile, not that they compute the right
numbers there (interpret-mode tests check the numbers).

The variants are a covering set, not the full product: every page format
(dense f32/bf16/fp8, int8/int4/int2 per token with and without offsets,
16-bit and f32 parameters, KIVI 4/2-bit keys with 4/2-bit values, narrow and
wide table windows), per-head and shared block tables, per-token key scales
applied to the scores, head dims 64 and 128, page sizes 16 to 256, decode and
prefill chunks up to the 256 query rows `attend_pallas` gives one call,
flash-decoding splits, window and soft-cap, GQA groups 1 to 8, f32 and bf16
MXU operands; and the whole SmolLM2-shaped decode step with `impl="pallas"`
over a KIVI chain cache.

Needs the `tpu-compile` extra (`pip install -e '.[tpu-compile]'`); skipped
only when libtpu cannot be imported.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import pytest

from experiments.cli.compile_cmd import kernel_calls
from kernels_pallas import page_formats as pf
from kernels_pallas import tpu_compile as tc
from kernels_pallas.paged_attention import paged_attention
from kvjax.backends.pallas import MAX_QUERY_ROWS

if not tc.libtpu_available():
    pytest.skip("libtpu is not importable: install the extra, pip install -e '.[tpu-compile]'",
                allow_module_level=True)

PT, PC, DENSE = pf.PackedTokens, pf.PackedChannels, pf.DENSE
BF16, F32 = jnp.bfloat16, jnp.float32


class Variant(NamedTuple):
    name: str
    k_format: pf.Format
    v_format: pf.Format
    head_dim: int
    page_size: int
    t: int  # queries per sequence: 1 = decode, > 1 = a prefill chunk
    gqa: int  # query heads per KV head
    kv_heads: int = 2
    table: int = 4  # pages per row
    pages_per_split: int = 4  # < table: flash-decoding splits
    window: int | None = None
    softcap: float | None = None
    q_dtype: object = BF16
    page_dtype: object = BF16  # dense pages only
    batch: int = 2
    pages_per_block: int | None = None  # TPU pages per grid step (default: >= 512 slots)
    shared_tables: bool = False  # [B, NP] tables shared by a sequence's KV heads (head_stride)


VARIANTS = [
    Variant("dense-f32 d64 p16 decode mha 2-page blocks 2 splits", DENSE, DENSE, 64, 16, 1, 1,
            q_dtype=F32, page_dtype=F32, table=8, pages_per_block=2),
    Variant("dense-bf16 d128 p256 decode gqa8 split", DENSE, DENSE, 128, 256, 1, 8, kv_heads=1,
            table=6, pages_per_split=2),
    Variant("dense-bf16 d64 p128 prefill16 gqa3 window softcap", DENSE, DENSE, 64, 128, 16, 3,
            kv_heads=3, window=100, softcap=30.0),
    Variant("dense-bf16 slots-last d64 p256 decode gqa3 split", pf.DENSE_T, pf.DENSE_T, 64, 256,
            1, 3, kv_heads=3, table=8, pages_per_split=4),
    Variant("fp8-e4m3 slots-last d64 p64 prefill4 gqa2", pf.DENSE_T, pf.DENSE_T, 64, 64, 4, 2,
            page_dtype=jnp.float8_e4m3fn),
    Variant("fp8-e4m3 d128 p64 decode gqa4 split", DENSE, DENSE, 128, 64, 1, 4,
            page_dtype=jnp.float8_e4m3fn, pages_per_split=2),
    Variant("fp8-e5m2 d64 p32 prefill5 gqa2 f32-q", DENSE, DENSE, 64, 32, 5, 2,
            page_dtype=jnp.float8_e5m2, q_dtype=F32),
    Variant("int8 g64 d64 p32 decode gqa2", PT(8, 64), PT(8, 64), 64, 32, 1, 2),
    Variant("int8-sym g32 d128 p128 prefill8 gqa1 f32-q", PT(8, 32, True), PT(8, 32, True), 128,
            128, 8, 1, q_dtype=F32),
    Variant("int4 g32 d64 p64 decode gqa3 split", PT(4, 32), PT(4, 32), 64, 64, 1, 3,
            kv_heads=3, table=8, pages_per_split=3),
    Variant("int4-sym g32 d128 p256 decode gqa8", PT(4, 32, True), PT(4, 32, True), 128, 256, 1,
            8),
    Variant("int4 g128 d128 p16 prefill5 gqa2 softcap", PT(4, 128), PT(4, 128), 128, 16, 5, 2,
            softcap=20.0),
    Variant("int2 g16 d64 p16 decode gqa6 window", PT(2, 16), PT(2, 16), 64, 16, 1, 6, window=40),
    Variant("int2-sym g32 d128 p64 decode gqa4 split f32-q", PT(2, 32, True), PT(2, 32, True),
            128, 64, 1, 4, pages_per_split=1, q_dtype=F32),
    Variant("int4 bf16-params d64 p128 decode gqa3", PT(4, 32, param_dtype="bfloat16"),
            PT(4, 32, param_dtype="bfloat16"), 64, 128, 1, 3, kv_heads=3),
    Variant("int8 f32-params d128 p32 decode gqa4", PT(8, 64, param_dtype="float32"),
            PT(8, 64, param_dtype="float32"), 128, 32, 1, 4),
    Variant("kivi4 keys int4 values d64 p64 decode gqa3", PC(4, 4), PT(4, 32), 64, 64, 1, 3,
            kv_heads=3),
    Variant("kivi2 keys int2 values d128 p256 decode gqa4 split 1-page blocks", PC(2, 16),
            PT(2, 32), 128, 256, 1, 4, table=4, pages_per_split=2, pages_per_block=1),
    Variant("kivi4 keys int2 values d128 p16 prefill16 gqa8 window softcap", PC(4, 2), PT(2, 32),
            128, 16, 16, 8, kv_heads=1, window=30, softcap=50.0),
    Variant("kivi2-sym keys int4 values d64 p32 decode gqa1 f32-q", PC(2, 2, True), PT(4, 32), 64,
            32, 1, 1, q_dtype=F32),
    Variant("kivi4 wide-window64 keys int4 values d64 p128 decode gqa3", PC(4, 64), PT(4, 32), 64,
            128, 1, 3, kv_heads=3),
    Variant("kivi2 f32-params keys int2 values d64 p64 prefill4 gqa2", PC(2, 4, param_dtype="float32"),
            PT(2, 32), 64, 64, 4, 2),
    Variant("kivi4 keys dense-bf16 values d128 p128 decode gqa4", PC(4, 8), DENSE, 128, 128, 1, 4),
    Variant("dense-bf16 shared tables d64 p64 decode gqa3 window split", DENSE, DENSE, 64, 64, 1,
            3, kv_heads=3, table=8, pages_per_split=4, pages_per_block=2, window=200,
            shared_tables=True),
    Variant("kivi2 shared tables keys int2 values d128 p32 prefill4 gqa4", PC(2, 2), PT(2, 32),
            128, 32, 4, 4, shared_tables=True),
    Variant("int8-sym g=D keys (scales on scores) int4 values d64 p64 decode gqa3 softcap",
            PT(8, 64, True), PT(4, 32), 64, 64, 1, 3, kv_heads=3, softcap=30.0),
    Variant("int4 rows (store layout) 2 key groups on scores d64 p64 decode gqa3",
            pf.PackedTokenRows(4, 32), pf.PackedTokenRows(4, 32), 64, 64, 1, 3, kv_heads=3),
    Variant("int2 rows 8 key groups on scores g16 d128 p64 prefill4 gqa2 softcap",
            pf.PackedTokenRows(2, 16), pf.PackedTokenRows(4, 32), 128, 64, 4, 2, softcap=30.0),
    Variant("int2-sym rows (store layout) g=D keys d128 p16 prefill4 gqa2 window",
            pf.PackedTokenRows(2, 128, True), pf.PackedTokenRows(2, 32, True), 128, 16, 4, 2,
            window=20),
    Variant("int4-sym g=D bf16-params keys (scales on scores) d128 p128 prefill8 gqa4 f32-q",
            PT(4, 128, True, "bfloat16"), PT(4, 128, True, "bfloat16"), 128, 128, 8, 4,
            q_dtype=F32),
    # the largest query block attend_pallas gives one TPU call (MAX_QUERY_ROWS["tpu"] rows)
    Variant("kivi4 keys int4 values d128 p256 prefill32 gqa8 (256 rows)", PC(4, 2), PT(4, 32),
            128, 256, 32, 8, kv_heads=1),
    Variant("dense-f32 d128 p256 prefill256 mha (256 rows)", DENSE, DENSE, 128, 256, 256, 1,
            kv_heads=1, q_dtype=F32, page_dtype=F32),
]


def variant_args(v: Variant, device):
    """Abstract kernel arguments of a variant on `device`."""
    a = lambda shape, dtype: tc.abstract(shape, dtype, device)
    n_pages = v.batch * v.kv_heads * v.table + 1
    pool = lambda fmt: tuple(a(x.shape, x.dtype) for x in
                             fmt.shapes(n_pages, v.page_size, v.head_dim, v.page_dtype))
    heads = v.kv_heads * v.gqa
    return (a((v.batch, v.t, heads, v.head_dim), v.q_dtype), a((v.batch, v.t), jnp.int32),
            pool(v.k_format), pool(v.v_format), a((n_pages, 1, v.page_size), jnp.int32),
            a((v.batch, v.table) if v.shared_tables else (v.batch, v.kv_heads, v.table),
              jnp.int32), a((v.batch, v.kv_heads), jnp.int32))


def compile_variant(v: Variant, chip: str):
    device = tc.tpu_device(chip)
    fn = functools.partial(paged_attention, k_format=v.k_format, v_format=v.v_format,
                           pages_per_split=v.pages_per_split, window=v.window,
                           softcap=v.softcap, backend="tpu", pages_per_block=v.pages_per_block,
                           head_stride=v.batch * v.table if v.shared_tables else None)
    return tc.compile_for(device, fn, *variant_args(v, device))


def test_every_kernel_variant_compiles_for_v5e_and_v6e(capsys):
    failures, start = [], time.time()
    for chip in tc.CHIPS:
        for v in VARIANTS:
            try:
                compile_variant(v, chip)
            except Exception as e:  # noqa: BLE001 - every Mosaic rejection is reported
                failures.append(f"{chip} {v.name}: {str(e).splitlines()[0][:300]}")
    total = len(VARIANTS) * len(tc.CHIPS)
    with capsys.disabled():
        print(f"\n{total - len(failures)}/{total} kernel variants compile for "
              f"{' and '.join(tc.CHIPS)} ({len(VARIANTS)} variants x {len(tc.CHIPS)} chips, "
              f"{time.time() - start:.0f} s)")
    assert not failures, "Mosaic rejected:\n" + "\n".join(failures)


def test_variants_cover_every_format_and_path():
    """The covering set keeps covering what the module docstring promises."""
    kinds = {(type(v.k_format).__name__, getattr(v.k_format, "bits", None),
              getattr(v.k_format, "symmetric", None)) for v in VARIANTS}
    kinds |= {(type(v.v_format).__name__, getattr(v.v_format, "bits", None),
               getattr(v.v_format, "symmetric", None)) for v in VARIANTS}
    for bits in (8, 4, 2):
        assert ("PackedTokens", bits, False) in kinds and ("PackedTokens", bits, True) in kinds
    for bits in (4, 2):
        assert ("PackedChannels", bits, False) in kinds
    dense = {jnp.dtype(v.page_dtype).name for v in VARIANTS if isinstance(v.k_format, pf.Dense)}
    assert pf.DENSE_T in {v.k_format for v in VARIANTS}
    assert {"float32", "bfloat16", "float8_e4m3fn"} <= dense
    assert {v.head_dim for v in VARIANTS} == {64, 128}
    assert {16, 32, 64, 128, 256} <= {v.page_size for v in VARIANTS}
    assert {1, 2, 3, 4, 6, 8} <= {v.gqa for v in VARIANTS}
    assert any(v.t == 1 for v in VARIANTS) and any(v.t > 1 for v in VARIANTS)
    assert max(v.t * v.gqa for v in VARIANTS) == MAX_QUERY_ROWS["tpu"]  # attend_pallas' largest
    assert any(v.pages_per_split < v.table for v in VARIANTS)
    assert any(v.pages_per_block and v.pages_per_block < v.pages_per_split for v in VARIANTS)
    assert any(v.window for v in VARIANTS) and any(v.softcap for v in VARIANTS)
    assert {jnp.dtype(v.q_dtype).name for v in VARIANTS} == {"float32", "bfloat16"}
    assert any(v.shared_tables for v in VARIANTS) and not all(v.shared_tables for v in VARIANTS)
    assert any(getattr(v.k_format, "scales_scores", lambda d: False)(v.head_dim)
               for v in VARIANTS)


def test_smollm2_decode_step_with_kivi_chain_compiles(monkeypatch, capsys):
    """The whole SmolLM2-shaped decode step (random abstract weights, bf16), impl="pallas", over a
    cache compressed by StreamingLLM then KIVI-2: every layer's attention runs in the kernels."""
    from flax import nnx

    import kvjax
    from kvjax.backends import dispatch
    from models.llama import Llama, LlamaConfig, new_cache

    # on a CPU host `pallas_backend()` is None and attend would fall back to XLA
    monkeypatch.setattr(dispatch, "pallas_backend", lambda: "tpu")
    cfg = dataclasses.replace(LlamaConfig.smollm2_135m(), num_layers=4)
    batch, capacity = 8, 1024
    abstract_model = nnx.eval_shape(lambda: Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract_model)
    chain = kvjax.parse_method("streaming_llm:sinks=4,window=508+kivi:bits=2,group=32,residual=64")

    def compressed():
        cache = new_cache(cfg, batch, capacity)
        return chain.update(cache, chain.init(cache), None)[0]

    cache = jax.eval_shape(compressed)
    assert isinstance(cache[0], kvjax.ResidualCache)
    device = tc.tpu_device("v5e")

    def step(state, tokens, positions, cache):
        model = nnx.merge(graphdef, state)
        return model(tokens, positions, cache, impl="pallas")

    args = tc.abstract_like((state, jax.ShapeDtypeStruct((batch, 1), jnp.int32),
                             jax.ShapeDtypeStruct((batch, 1), jnp.int32), cache), device)
    start = time.time()
    compiled = tc.compile_for(device, step, *args)
    kernels = sum("tpu_custom_call" in line and "custom-call(" in line
                  for line in compiled.as_text().splitlines())
    with capsys.disabled():
        print(f"\nSmolLM2-shaped decode step (4 layers, KIVI-2 chain, batch {batch}, capacity "
              f"{capacity}) compiles for v5e: {kernels} Mosaic kernel calls, "
              f"{time.time() - start:.0f} s")
    # per layer: the recent part, and the body with narrow KIVI table windows (pages whose
    # groups spread take XLA's block loop, no kernel: kvjax.backends.pallas.attend_partial)
    assert kernels == cfg.num_layers * 2


def test_window_shrinks_the_compiled_cost_in_proportion(capsys):
    """With a 512-token window over 4096-token rows the compiled program (kernel estimate + the
    XLA start computation) moves about the window's share of the pages: at most 9 of 64 pages
    of 64 slots (window + T - 1 slots span <= 9 pages), plus 4 bytes per listed slot of positions
    read to find the starts."""
    from kernels_pallas.paged_attention import (cost_estimate, window_pages,
                                                window_start_pages)

    base = Variant("dense-bf16 d128 p64 decode gqa4 ctx4096", DENSE, DENSE, 128, 64, 1, 4,
                   table=64, pages_per_split=64)
    windowed = base._replace(name=base.name + " window512", window=512)
    cost = {}
    for v in (base, windowed):
        compiled = compile_variant(v, "v5e")
        cost[v.window] = compiled.cost_analysis()["bytes accessed"]
    device = tc.tpu_device("v5e")
    args = variant_args(base, device)
    rows = base.gqa * base.t
    qg = jax.ShapeDtypeStruct((base.batch, base.kv_heads, rows, base.head_dim), BF16)
    est = lambda n: cost_estimate(qg, DENSE, args[2], DENSE, args[3], args[4], args[5], 1,
                                  n).bytes_accessed
    assert window_pages(512, 1, 64) == 9
    # the XLA ops that find the starts (a gather of the listed slots' positions and a max),
    # compiled alone at the same shapes
    q_pos, pos, tables, counts = args[1], args[4], args[5], args[6]
    starts = tc.compile_for(device, functools.partial(window_start_pages, window=512), q_pos, pos,
                            tables, counts).cost_analysis()["bytes accessed"]
    ratio = cost[512] / cost[None]
    with capsys.disabled():
        print(f"\nwindow 512 of 4096 (batch 2, 2 KV heads, D 128, bf16): compiled bytes "
              f"{cost[512] / 2**20:.2f} MiB vs {cost[None] / 2**20:.2f} MiB without "
              f"({ratio:.3f}x; kernel estimate {est(9) / est(None):.3f}x = 9/64 pages plus "
              f"queries; start computation {starts / 2**20:.2f} MiB)")
    # the kernel's share shrinks to 9 of 64 pages per row; the rest of the program only
    # gains the start computation
    assert est(9) < est(None) * 10 / 64
    assert cost[512] <= est(9) + (cost[None] - est(None)) + starts + 4096


@pytest.mark.parametrize("chip", tc.CHIPS)
def test_shared_tables_fit_smem_where_per_head_tables_do_not(chip, capsys):
    """Batch 64 x 32k tokens x 8 KV heads in pages of 64: per-head [B, KVH, NP] int32 tables are
    1 MiB, all of SMEM, and Mosaic rejects the kernel; the [B, NP] tables its heads share are
    128 KiB and it compiles."""
    b, kvh, g, d, s, ctx = 64, 8, 4, 128, 64, 32768
    n_table = ctx // s
    device = tc.tpu_device(chip)
    a = lambda shape, dtype: tc.abstract(shape, dtype, device)
    fmt = PT(4, 32)
    n_pages = b * kvh * n_table
    pool = tuple(a(x.shape, x.dtype) for x in fmt.shapes(n_pages, s, d))

    def compile_with(tables_shape, head_stride):
        fn = functools.partial(paged_attention, k_format=fmt, v_format=fmt, backend="tpu",
                               pages_per_split=n_table, head_stride=head_stride)
        return tc.compile_for(device, fn, a((b, 1, kvh * g, d), BF16), a((b, 1), jnp.int32),
                              pool, pool, a((n_pages, 1, s), jnp.int32),
                              a(tables_shape, jnp.int32), a((b, kvh), jnp.int32))

    with pytest.raises(Exception, match="(?i)smem"):
        compile_with((b, kvh, n_table), None)
    compile_with((b, n_table), kvh * n_table)
    with capsys.disabled():
        print(f"\n{chip}: batch 64 x 32k x 8 KV heads, pages of 64: per-head tables "
              f"{b * kvh * n_table * 4 // 1024} KiB overflow SMEM; shared tables "
              f"{b * n_table * 4 // 1024} KiB compile")


def kernel_splits(hlo: str) -> list[int]:
    """The flash-decoding splits of each TPU kernel call in a compiled program: the leading dim
    of its partial-output shape (`f32[splits, B, KVH, rows, D]`)."""
    return [int(n) for n in re.findall(r"kvjax_paged_attention_tpu[.\d]* = \(f32\[(\d+),", hlo)]


def own_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_shared_table_paged_layer_fits_smem_where_per_head_tables_do_not(capsys):
    """The whole attend(impl="pallas") step over a PagedLayer of batch 64 x 32k tokens x 8 KV
    heads in int4 pages of 64 (v5e): with per-head [B, KVH, NP] tables (1 MiB) Mosaic rejects it
    for SMEM; with `init_paged_cache(shared_tables=True)` the kernel gets [B, NP] tables
    (128 KiB, head_stride=1) and it compiles, moving at most 1.2x the layer's bytes: its
    pages are held lane-flat (`TokenPages`), so the pool is not relaid out per call (a
    `[P, 64, W]` pool was: 4.0x)."""
    from kvjax.backends import pallas as ka
    from kvjax.memory.paging import init_paged_cache

    b, kvh, heads, d, s, ctx = 64, 8, 32, 128, 64, 32768
    n_table = ctx // s
    device = tc.tpu_device("v5e")
    q = tc.abstract((b, 1, heads, d), BF16, device)
    q_pos = tc.abstract((b, 1), jnp.int32, device)
    step = functools.partial(ka.attend_pallas, backend="tpu")

    def layer_with(shared_tables):
        return jax.eval_shape(lambda: init_paged_cache(
            (b * n_table + 1) * kvh, s, b, kvh, n_table, d, num_layers=1, bits=4, group=32,
            shared_tables=shared_tables))[1][0]

    compile_with = lambda shared: tc.compile_for(device, step, q, q_pos,
                                                 tc.abstract_like(layer_with(shared), device))
    with pytest.raises(Exception, match="(?i)smem"):
        compile_with(False)
    compiled = compile_with(True)
    # a batch's decode on TPU is one split per row: here 64 splits of 8 pages moved 0.17x
    # the pool's bytes more in their partial outputs and merges (docs/DECISIONS.md)
    assert kernel_splits(compiled.as_text()) == [1]
    ratio = compiled.cost_analysis()["bytes accessed"] / own_bytes(layer_with(True))
    assert ratio <= 1.2
    with capsys.disabled():
        print(f"\nv5e PagedLayer int4 batch 64 x 32k x 8 KV heads, pages of 64: per-head "
              f"tables {b * kvh * n_table * 4 // 1024} KiB overflow SMEM; shared_tables "
              f"{b * n_table * 4 // 1024} KiB compile, {ratio:.3f}x the layer's bytes")


def test_paged_kivi_with_shared_tables_fits_smem_at_64_x_32k(capsys):
    """A paged KIVI layer (one 32-token group a page) of batch 64 x 32k tokens x 8 KV heads,
    Llama-3-8B's head dim, through attend(impl="pallas") on v5e: per-head [B, KVH, NP] tables
    are 2 MiB, twice SMEM, and Mosaic rejects the kernel; with the pages allocated as
    `from_residual(shared_tables=True)` allocates them the kernel reads one [B, NP] table
    (256 KiB) and the step compiles (two calls: the body's pages and the exact part), moving
    at most 1.2x the layer's bytes (its key and value pages are held lane-flat; as `[P, 32, W]`
    pools they were relaid out per call: 5.7x). The layer is built abstractly as
    `from_residual` builds it (its copy needs concrete tokens)."""
    from kvjax.backends import pallas as ka
    from kvjax.memory.paged_kivi import ChannelPages, PagedKivi
    from kvjax.memory.paging import TokenPages, init_paged_cache
    import kvjax

    b, kvh, heads, d, g, ctx, res = 64, 8, 32, 128, 32, 32768, 128
    n_table = ctx // g

    def layer(shared_tables):
        n_pages = (b * n_table + 1) * kvh
        _, (body,) = init_paged_cache(n_pages, g, b, kvh, n_table, d, 1,
                                      shared_tables=shared_tables)
        body = body.replace(k=ChannelPages.empty(n_pages, g, d, 4, jnp.float16),
                            v=TokenPages.empty(n_pages, g, d, 4, 32, False, jnp.float16))
        recent = kvjax.init_cache(b, kvh, res + g, d, dtype=BF16)  # the exact part, as deployed
        return PagedKivi(body=body, recent=recent, residual=res)

    device = tc.tpu_device("v5e")
    q = tc.abstract((b, 1, heads, d), BF16, device)
    q_pos = tc.abstract((b, 1), jnp.int32, device)
    step = functools.partial(ka.attend_pallas, backend="tpu")
    compile_with = lambda shared: tc.compile_for(device, step, q, q_pos, tc.abstract_like(
        jax.eval_shape(lambda: layer(shared)), device))
    with pytest.raises(Exception, match="(?i)smem"):
        compile_with(False)
    compiled = compile_with(True)
    calls = kernel_calls(compiled.as_text())
    ratio = compiled.cost_analysis()["bytes accessed"] / own_bytes(jax.eval_shape(
        lambda: layer(True)))
    with capsys.disabled():
        print(f"\nv5e paged KIVI-4 batch 64 x 32k x 8 KV heads, pages of {g}: per-head tables "
              f"{b * kvh * n_table * 4 // 1024} KiB overflow SMEM; shared_tables "
              f"{b * n_table * 4 // 1024} KiB compile ({calls} Mosaic calls, {ratio:.3f}x "
              f"the layer's bytes)")
    assert calls == 2 and ratio <= 1.2


def _written_at_least(hlo: str, n: int) -> list[str]:
    """HLO ops whose result has >= n elements: a copy of the cache. Parameters, bitcasts and
    the ops that pass a value along without writing it (tuples, loops, conditionals) are not
    writes."""
    import math
    import re

    passes = ("parameter(", "bitcast(", "get-tuple-element(", "tuple(", "while(", "conditional(")
    out = []
    for line in hlo.splitlines():
        m = re.search(r" = \(?\w+\[([\d,]*)\]", line)
        if m and not any(op in line for op in passes) and m.group(1) and \
                math.prod(int(x) for x in m.group(1).split(",")) >= n:
            out.append(line.strip()[:160])
    return out


def _token_cache_step_bytes(chip, store, b, kvh, heads, d, c, hlo=False):
    """(whole compiled attend(impl="pallas") step bytes, the kernel's own estimate, kernel
    inputs) over an abstract TokenCache whose k and v are `store()` ([R, C, D] rows)."""
    from kernels_pallas.paged_attention import block_sizes, cost_estimate, rows_as_pages
    from kvjax.backends import pallas as ka
    from kvjax.core.cache import EMPTY, TokenCache

    device = tc.tpu_device(chip)
    layer = jax.eval_shape(lambda: TokenCache(k=store(), v=store(), pos=jnp.full(
        (b, kvh, c), EMPTY, jnp.int32), length=jnp.zeros((), jnp.int32), mass=None))
    q, q_pos = jax.ShapeDtypeStruct((b, 1, heads, d), BF16), jax.ShapeDtypeStruct(
        (b, 1), jnp.int32)
    step = functools.partial(ka.attend_pallas, backend="tpu")
    compiled = tc.compile_for(device, step, *tc.abstract_like((q, q_pos, layer), device))
    statics = {}

    def inputs(layer):
        kin = ka.kernel_inputs(layer, backend="tpu")
        statics.update({k: kin.pop(k) for k in ("k_format", "v_format", "row_pages")})
        return kin

    kin = jax.eval_shape(inputs, layer)
    kf, vf, n = statics["k_format"], statics["v_format"], statics["row_pages"]
    tup = lambda x: x if isinstance(x, tuple) else (x,)
    pos, k, v = jax.eval_shape(lambda p, k, v: rows_as_pages(p, k, v, kf, vf, n),
                               kin["pos_pages"], tup(kin["k_pages"]), tup(kin["v_pages"]))
    qg = jax.ShapeDtypeStruct((b, kvh, heads // kvh, d), BF16)
    splits = block_sizes(n, c // n, ka.default_pages_per_split("tpu", b, 1), None)[2]
    est = cost_estimate(qg, kf, k, vf, v, pos, kin["block_tables"], splits).bytes_accessed
    out = compiled.cost_analysis()["bytes accessed"], est, layer
    return (*out, compiled.as_text()) if hlo else out


@pytest.mark.parametrize("chip", tc.CHIPS)
def test_dense_token_cache_step_moves_about_the_kernels_bytes(chip, capsys):
    """attend(impl="pallas")'s whole compiled step over a dense bf16 TokenCache (SmolLM2 and
    Llama-3-8B attention shapes, batch 8, 4096 slots) moves at most 10% more bytes than the
    kernel's own estimate: the kernel reads the cache's rows in place (`row_pages`), no page pool
    is built (before: 8.2x the kernel's bytes at D = 64, docs/drafts/kernels.md)."""
    for kvh, heads, d in ((3, 9, 64), (8, 32, 128)):
        b, c = 8, 4096
        whole, est, _ = _token_cache_step_bytes(chip, lambda: jnp.zeros((b * kvh, c, d), BF16),
                                                b, kvh, heads, d, c)
        with capsys.disabled():
            print(f"\n{chip} dense bf16 TokenCache b{b} kvh{kvh} D{d} C{c}: whole step "
                  f"{whole / 2**20:.2f} MiB, kernel {est / 2**20:.2f} MiB ({whole / est:.3f}x)")
        assert whole <= 1.1 * est


@pytest.mark.parametrize("chip,bits,group,symmetric,d", [
    ("v5e", 4, 32, False, 64), ("v6e", 4, 32, False, 64), ("v5e", 2, 32, True, 128),
    ("v5e", 8, 64, True, 64)])
def test_packed_token_cache_step_reads_codes_in_place(chip, bits, group, symmetric, d, capsys):
    """attend(impl="pallas") over a PackedTokens TokenCache (batch 64, 32k slots) compiles with the
    code words read in place (`PackedTokenRows` row pools: no XLA op writes an array as large
    as the code words); the whole step moves at most 2.2x the kernel's own bytes (measured 1.5-2.0x:
    the float16 parameters' copy as uint16 bits, as Mosaic takes no float16 arguments, a
    layout copy of the positions and XLA's prefetches of small arrays into VMEM; before: 11-13x,
    a converted copy of the whole cache, docs/drafts/kernels.md). g = D covers scales applied
    on the scores."""
    from kvjax.core import stores

    b, c = 64, 32768
    kvh, heads = (3, 9) if d == 64 else (8, 32)
    store = lambda: stores.PackedTokens.empty(b * kvh, c, d, bits, group, symmetric=symmetric)
    whole, est, layer, hlo = _token_cache_step_bytes(chip, store, b, kvh, heads, d, c, hlo=True)
    assert not _written_at_least(hlo, b * kvh * c * (d * bits // 32))
    nbytes = lambda x: x.size * x.dtype.itemsize
    params = sum(nbytes(x) for s in (layer.k, layer.v) for x in (s.scale, s.offset)
                 if x is not None)
    with capsys.disabled():
        print(f"\n{chip} int{bits} g{group}{' sym' if symmetric else ''} TokenCache b{b} kvh{kvh} "
              f"D{d} C{c}: whole step {whole / 2**20:.1f} MiB, kernel {est / 2**20:.1f} MiB "
              f"({whole / est:.2f}x), f16 params {params / 2**20:.1f} MiB")
    assert whole <= 2.2 * est


def test_token_parameters_are_read_in_place(capsys):
    """A per-token int4 TokenCache (Llama-3-8B's attention shape, batch 64, 32k slots, v5e)
    with bfloat16 or float16 parameters goes to the kernel with nothing copied: no XLA op
    writes as many elements as one parameter array, and the whole step moves at most 10% more
    than the kernel's own bytes. (SmolLM2's shape has parameter arrays of 25 MB, which XLA
    prefetches into VMEM whole before the call: a copy by the count, not extra HBM traffic.)
    Float16 parameters are stored as their uint16 bits (`stores.stored_params`): a float16
    array's uint16 view, which Mosaic needs (it takes no float16 arguments), XLA:TPU compiled
    as a copy every call (docs/DECISIONS.md "Float16 parameters stored as their bits")."""
    from kvjax.core import stores

    b, c, d, kvh, heads = 64, 32768, 128, 8, 32
    n_params = b * kvh * c * (d // 32)
    moved = {}
    for dtype in (jnp.bfloat16, jnp.float16):
        store = lambda: stores.PackedTokens.empty(b * kvh, c, d, 4, 32, param_dtype=dtype)
        whole, est, _, hlo = _token_cache_step_bytes("v5e", store, b, kvh, heads, d, c, hlo=True)
        moved[jnp.dtype(dtype).name] = (whole, est, _written_at_least(hlo, n_params))
    for name, (whole, est, writes) in moved.items():
        assert writes == [] and whole <= 1.1 * est, (name, whole / est, writes)
    with capsys.disabled():
        print("\nint4 TokenCache b64 x 32k: whole step / kernel bytes "
              + ", ".join(f"{k} {w / e:.3f}x" for k, (w, e, _) in moved.items()))


@pytest.mark.parametrize("chip,bits,param_dtype,d,t", [
    ("v5e", 4, "float16", 64, 1), ("v6e", 2, "bfloat16", 128, 1), ("v5e", 4, "float32", 128, 1),
    ("v6e", 4, "float16", 64, 32)])
def test_kivi_token_cache_keys_compile_read_in_place(chip, bits, param_dtype, d, t, capsys):
    """attend(impl="pallas") over a KIVI body (keys `PackedChannels`, values `PackedTokens`,
    batch 64 x 32k slots) compiles for the chip with Mosaic reading the key codes in place
    (`PackedChannelRows` row pools, windows named per page in SMEM): the kernel is in the
    program and no XLA op writes an array as large as the key code words (before: a converted
    page pool of them every call). t = 32: a prefill chunk of 32 query tokens."""
    from kvjax.backends import pallas as ka
    from kvjax.core import stores
    from kvjax.core.cache import EMPTY, TokenCache

    b, c = 64, 32768
    kvh, heads = (3, 9) if d == 64 else (8, 32)
    dtype = jnp.dtype(param_dtype)
    layer = jax.eval_shape(lambda: TokenCache(
        k=stores.PackedChannels.empty(b * kvh, c, d, bits, 32, param_dtype=dtype),
        v=stores.PackedTokens.empty(b * kvh, c, d, bits, 32, param_dtype=dtype),
        pos=jnp.full((b, kvh, c), EMPTY, jnp.int32), length=jnp.zeros((), jnp.int32), mass=None))
    inputs = jax.eval_shape(lambda l: {k: v for k, v in ka.kernel_inputs(l, backend="tpu").items()
                                       if k not in ("k_format", "v_format", "row_pages")}, layer)
    assert "table_windows" in inputs
    device = tc.tpu_device(chip)
    q, q_pos = jax.ShapeDtypeStruct((b, t, heads, d), BF16), jax.ShapeDtypeStruct((b, t), jnp.int32)
    step = functools.partial(ka.attend_pallas, backend="tpu")
    start = time.time()
    hlo = tc.compile_for(device, step, *tc.abstract_like((q, q_pos, layer), device)).as_text()
    assert kernel_calls(hlo) >= 1
    assert not _written_at_least(hlo, b * kvh * c * (d * bits // 32))
    with capsys.disabled():
        print(f"\n{chip} KIVI-{bits} {param_dtype} keys D{d} b{b} x {c}, {t} query tokens: "
              f"compiled in {time.time() - start:.0f} s, codes read in place")


def _attend_kernel_calls(chip: str, layer, q_shape) -> int:
    """Mosaic calls in `attend_pallas` over `layer` compiled for `chip`, bfloat16 queries of
    `q_shape` [B, T, H, D]."""
    from kvjax.backends import pallas as ka
    device = tc.tpu_device(chip)
    q = tc.abstract(q_shape, BF16, device)
    q_pos = tc.abstract(q_shape[:2], jnp.int32, device)
    step = functools.partial(ka.attend_pallas, backend="tpu")
    return kernel_calls(tc.compile_for(device, step, q, q_pos,
                                       tc.abstract_like(layer, device)).as_text())


def _cache_kinds() -> dict:
    """One small concrete layer of every cache kind the kernel reads (batch 2, 2 KV heads,
    D 128, 400 tokens written), by name."""
    import numpy as np
    import kvjax
    from kvjax.memory import tiers
    from kvjax.policies.low_rank import LowRankBasis, low_rank
    from kvjax.memory.paged_kivi import from_residual
    from kvjax.memory.paging import init_paged_cache, reserve

    b, kvh, d, n = 2, 2, 128, 400
    k = jnp.linspace(-1, 1, b * kvh * n * d, dtype=jnp.float32).reshape(b, kvh, n, d)
    pos = jnp.broadcast_to(jnp.arange(n), (b, n))
    token = kvjax.write(kvjax.init_cache(b, kvh, 512, d), k, -k, pos)

    def method(m):
        t = kvjax.parse_method(m)
        (out,), _ = t.update((token,), t.init((token,)), None)
        return out

    def paged(init, **kw):
        pool, layers = init(b, kvh, 4, d, num_layers=1, bits=4, **kw)
        pool, layers = reserve(pool, layers, jnp.full((b,), n))
        return pool, (layers[0].write(k, -k, pos),)

    kinds = {m: method(m) for m in ("full", "fp8", "quantize:bits=8", "quantize:bits=4",
                                    "quantize:bits=4,axis=channel", "kivi:bits=4",
                                    "knorm:ratio=0.5+kivi:bits=2",
                                    "quantize:bits=4+knorm:ratio=0.5,headwise=true")}
    kinds["PagedLayer int4"] = paged(lambda *a, **kw: init_paged_cache(
        b * kvh * 4 + 1, 128, *a, **kw), shared_tables=False)[1][0]
    for shared in (False, True):  # per-head tables, and one [B, NP] table per tier
        pool, layers = paged(lambda *a, **kw: tiers.init_tiered_cache(
            b * kvh * 4 + 2, 4, 128, *a, **kw), shared_tables=shared)
        pool, layers = tiers.spill(pool, layers, tiers.coldest_pages(
            layers[0], tiers.recency_scores(layers[0]), 2))
        name = "TieredLayer int4" + (", shared tables" if shared else "")
        kinds[name] = tiers.prefetch(layers, tiers.host_pages_in_use(layers[0]))[0]
    kivi = kvjax.kivi(bits=4, group=32, residual=32)
    unpaged, _ = kivi.update((token,), kivi.init((token,)), None)
    kinds["PagedKivi"] = from_residual(unpaged, max_pages=16, device_pages=b * kvh * 16 + 1)[1][0]
    eye = np.broadcast_to(np.eye(d, dtype=np.float32), (1, kvh, d, d))
    energy = np.ones((1, kvh, d), np.float32)
    latent = low_rank(LowRankBasis(eye, eye, energy, energy, tokens=1), rank=64, key_rank=32)
    kinds["low-rank keys 32, values 64"] = latent.update((token,), latent.init((token,)),
                                                         None)[0][0]
    return kinds


@pytest.mark.parametrize("chip", tc.CHIPS)
def test_every_cache_kind_compiles_through_the_kernel_for_decode_and_prefill(chip, capsys):
    """Every layer kind `attend(impl="pallas")` reads -- `TokenCache` with dense, fp8, int8,
    int4, per-channel int4 and KIVI stores (a residual layer, also after Knorm), a paged
    layer, a tiered one (host pages staged; per-head and shared tables) and a paged KIVI one -- compiles with Mosaic for
    the chip, for a decode step (1 query token) and a prefill chunk (100 tokens of 4 query
    heads per KV head: two query blocks), with a Mosaic call per part and block and no XLA
    fallback; a low-rank layer too (over its latents: keys of rank 32, values of 64) and a
    pooled one (head-wise budgets, int4: one row per sequence holding all 8 query heads, so
    four query blocks for the chunk)."""
    from kvjax.backends import pallas as ka

    kinds = _cache_kinds()
    for name in ("kivi:bits=4", "knorm:ratio=0.5+kivi:bits=2"):  # each kind is what it says
        assert type(kinds[name]).__name__ == "ResidualCache", name
    assert int((kinds["knorm:ratio=0.5+kivi:bits=2"].body.pos != -1).sum()) < 2 * 2 * 400 // 2
    assert kinds["quantize:bits=4+knorm:ratio=0.5,headwise=true"].pooled
    assert all(view.shared_tables for view in ka.tier_views(kinds["TieredLayer int4, shared "
                                                                  "tables"]))
    for name, layer in kinds.items():
        assert ka.kernel_refusal(layer, "tpu") is None, name
        parts = 2 if ka.kernel_layout(layer) in ("parts", "tiers") else 1
        rows_per_token = 8 // ka.row_heads(layer)  # query heads a kernel row holds
        assert rows_per_token == (8 if "headwise" in name else 4), name
        for t in (1, 100):
            calls = _attend_kernel_calls(chip, layer, (2, t, 8, 128))
            assert calls == parts * -(-t * rows_per_token // MAX_QUERY_ROWS["tpu"]), \
                (name, t, calls)
        with capsys.disabled():
            print(f"\n{chip} {name}: decode and prefill through the kernel")



@pytest.mark.parametrize("chip", tc.CHIPS)
def test_ragged_packed_queries_compile_as_one_kernel_call(chip, capsys):
    """`ragged_paged_attention` (packed tokens of many sequences: prefill chunks and decode
    tokens in one call, each block of 16 tokens reading its sequence's pages through `q_seq` in
    SMEM) compiles with Mosaic: 256 packed tokens of 8 query heads over 16 sequences' int4
    pages of 128 slots, bf16 queries, one Mosaic call."""
    from kernels_pallas.paged_attention import ragged_paged_attention

    device = tc.tpu_device(chip)
    a = lambda shape, dtype: tc.abstract(shape, dtype, device)
    n, heads, d, seqs, kvh, table, page = 256, 8, 128, 16, 2, 8, 128
    fmt = PT(4, 32)
    n_pages = seqs * kvh * table + 1
    pool = tuple(a(x.shape, x.dtype) for x in fmt.shapes(n_pages, page, d))
    fn = functools.partial(ragged_paged_attention, k_format=fmt, v_format=fmt, backend="tpu",
                           block_tokens=16)
    start = time.time()
    hlo = tc.compile_for(device, fn, a((n, heads, d), BF16), a((n,), jnp.int32),
                         a((seqs + 1,), jnp.int32), pool, pool,
                         a((n_pages, 1, page), jnp.int32), a((seqs, kvh, table), jnp.int32),
                         a((seqs, kvh), jnp.int32)).as_text()
    assert kernel_calls(hlo) == 1
    with capsys.disabled():
        print(f"\n{chip} ragged {n} tokens x {seqs} sequences: one Mosaic call, compiled in "
              f"{time.time() - start:.0f} s")
