"""Every registered method and a few chains generate on every valid prompt length.

Prompts of 1, 7, 31, 33, 127, 129 and 500 tokens straddle KIVI's default
group (32) and exact window (128): they run alone and in one mixed-length
batch, with and without decode-time compression, through the sampler on a
tiny random model. Nothing may raise, every logit must be finite, and a
codec's cache must give the logits its dequantized values give: one more
step over the encoded cache equals the same step with attention over a
plain float32 cache holding `view(cache)` (`attend_reference`), at float32
rounding. Then the regression cases of issue 21, one test each.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.core.cache import ResidualCache, TokenCache, flush_span, init_cache, view, write
from kvjax.policies.low_rank import LowRankBasis
from kvjax.core.stores import PackedChannels, is_encoded
from models.llama import Llama, LlamaConfig
from models.sampler import generate

LENGTHS = (1, 7, 31, 33, 127, 129, 500)
MAX_NEW = 5
# head_dim 32: the codecs' default group of channels; one layer: the sweep compiles ~150 programs
CONFIG = LlamaConfig.tiny(head_dim=32, max_position=1024, num_layers=1)

BASIS = "{basis}"  # replaced by the path of a random orthonormal basis (fixture `basis_file`)
DEFAULT_SPECS = {
    "full": "full",
    "streaming_llm": "streaming_llm:ratio=0.5",
    "sliding_window": "sliding_window:window=64",
    "snapkv": "snapkv:ratio=0.5",
    "pyramidkv": "pyramidkv:ratio=0.5",
    "tova": "tova:ratio=0.5",
    "h2o": "h2o:ratio=0.5",
    "knorm": "knorm:ratio=0.5",
    "random": "random:ratio=0.5",
    "expected_attention": "expected_attention:ratio=0.5",
    "quantize": "quantize",  # 4-bit, per token, groups of 32 channels
    "kivi": "kivi",  # 2-bit, groups of 32 tokens, the newest 128 exact
    "fp8": "fp8",
    "low_rank": f"low_rank:rank=16,basis={BASIS}",
    "linear_state": "linear_state",
    "fold": "snapkv:ratio=0.5+fold",  # folds what the part before it evicts
    "keydiff": "keydiff:ratio=0.5",
    "lagkv": "lagkv:ratio=0.5",
    "cur": "cur:ratio=0.5",
    "leverage": "leverage:ratio=0.5",
    "non_causal_attn": "non_causal_attn:ratio=0.5",
    "compactor": "compactor:ratio=0.5",
    "block": "block:inner=keydiff,ratio=0.5",
    "chunkkv": "chunkkv:inner=snapkv,ratio=0.5",
    "chunk": "chunk:inner=keydiff,ratio=0.5,chunk_length=16",  # several chunks per prompt
    "dms": "dms:inner=knorm,threshold=-4,window=16",  # no ratio: a threshold on -||k||
    "merging": "merging:inner=snapkv,ratio=0.5",
    "rerotate": "knorm:ratio=0.5+rerotate",
    "critical": "critical:inner=snapkv,ratio=0.5",
    "critical_ada": "critical_ada:inner=snapkv,ratio=0.5",
    "simlayerkv": "simlayerkv:lazy_threshold=0.0,n_recent=16",  # 0: every long row trims
    "think": "think:ratio=0.5",
    "cap": "cap:ratio=0.5",
    "entropy_chunkkv": "entropy_chunkkv:inner=snapkv,ratio=0.5",
    "finch": "finch:ratio=0.5,window=8",  # the prompt's last 8 tokens as the question
    "kvzip": "kvzip:ratio=0.5,prompt=bare",  # no tokenizer here: the chunks without kvpress's prompt
    "kvgrad": "kvgrad:ratio=0.5,prompt=bare",  # as kvzip, with the gradient (jax.grad)
    "duo_attention": f"duo_attention:head_ratio=0.5,scores={BASIS},sink=4,recent=8",
    "qfilter": f"qfilter:ratio=0.5,filters={BASIS}",
    "lukv": f"lukv:ratio=0.5,curve={BASIS}",
    "expected_attention_stats": f"expected_attention_stats:ratio=0.5,stats={BASIS}",
    "kvzap": f"kvzap:ratio=0.5,weights={BASIS}.kvzap",  # a random surrogate (orbax)
    "fastkvzip": f"fastkvzip:ratio=0.5,gates={BASIS}.fastkvzip",  # random gates (orbax)
    # random restore embeddings and LoRA (orbax); the chunks without kvpress's prompt, as kvzip
    "restorekv": f"restorekv:ratio=0.5,adapter={BASIS}.restorekv,prompt=bare",
    "kvcompose": "kvcompose:ratio=0.5",  # a pass over the context after prefill, as kvzip's
    "cam": "cam:ratio=0.5,merge_budget=4",  # merges only with compress_every (a decoding press)
    "decoding_ratio": "decoding_ratio:inner=knorm,ratio=0.5",
    "auto": "auto:budget=0.25",
}
"""A spec with sensible parameters (the factory's defaults where it has them) for every
method in `kvjax.METHODS`."""

RESTORE_TOKENS = 4  # the random RestoreKV adapter's (`random_basis`)
KVZIP_PLUS = "kvzip:ratio=0.5,prompt=bare,plus=true"  # KVzip+ normalization
MORE = ["quantize:bits=4,axis=channel", "quantize:bits=2,residual=48", KVZIP_PLUS,
        "chunk:inner=tova,ratio=0.5,chunk_length=16"]  # each chunk's own last query
CHAINS = ["snapkv:ratio=0.5+think:ratio=0.5",
          "snapkv:ratio=0.5+kivi:bits=4", "kivi:bits=2+snapkv:ratio=0.5",
          "h2o:ratio=0.5+quantize:bits=4,axis=channel"]


def registered_specs() -> list[str]:
    missing = sorted(set(kvjax.METHODS) - set(DEFAULT_SPECS))
    assert not missing, f"methods without sweep parameters: {missing}; add them to DEFAULT_SPECS"
    return list(DEFAULT_SPECS.values())


SPECS = registered_specs() + MORE + CHAINS
PROMPT_ONLY = {DEFAULT_SPECS["kvzip"], DEFAULT_SPECS["kvgrad"], KVZIP_PLUS,
               DEFAULT_SPECS["kvcompose"], DEFAULT_SPECS["restorekv"]}
"""Methods that compress the prompt only (kvzip, kvgrad, kvcompose, restorekv: their scores come
from a pass after prefill): with `compress_every` they must refuse by name."""


@pytest.fixture(scope="module")
def model():
    return Llama(CONFIG, rngs=nnx.Rngs(0))


def random_basis(path, layers: int, kv_heads: int, head_dim: int, heads: int | None = None,
                 hidden: int | None = None, model_layers: int | None = None) -> str:
    """Save a random orthonormal basis per layer and KV head (what `kvjax calibrate` writes)
    at `path`, with random artifacts of the other calibrated methods (`heads`: query heads,
    default `kv_heads`, for the query statistics); returns the path as a string. With
    `hidden`, also a random KVzap surrogate, random Fast KVzip gates and random RestoreKV
    tokens (orbax directories) at `path` + ".kvzap", ".fastkvzip" and ".restorekv" for a model
    of `model_layers` layers (default `layers`)."""
    rng = np.random.default_rng(0)
    if hidden is not None:
        from tests.test_kvzap import random_surrogate
        cfg = type("C", (), {"num_layers": model_layers or layers, "hidden_size": hidden,
                             "num_kv_heads": kv_heads})
        random_surrogate(cfg, "mlp").save(str(path) + ".kvzap")
        from tests.test_fastkvzip import random_gates
        random_gates(model_layers or layers, hidden, kv_heads,
                     (heads or kv_heads) // kv_heads).save(str(path) + ".fastkvzip")
        from tests.test_restorekv import random_restore_tokens
        random_restore_tokens(model_layers or layers, hidden, kv_heads, head_dim,
                              RESTORE_TOKENS).save(str(path) + ".restorekv")
    shape = (layers, kv_heads, head_dim, head_dim)
    keys, values = (np.linalg.qr(rng.standard_normal(shape))[0].astype(np.float32)
                    for _ in range(2))
    energy = np.tile(np.arange(head_dim, 0, -1, dtype=np.float32), shape[:2] + (1,))
    LowRankBasis(keys, values, energy, energy, 1).save(path)
    with np.load(path) as f:  # the same file also holds random DuoAttention head scores
        arrays = dict(f)  # and random Q-Filters and an LU-KV budget curve
    np.savez(path, **arrays, head_scores=rng.random(shape[:2]).astype(np.float32),
             q_filters=rng.standard_normal(shape[:3]).astype(np.float32),
             budget_curve=rng.uniform(0.05, 0.95, (99,) + shape[:2]).astype(np.float32),
             query_mean=rng.standard_normal((layers, heads or kv_heads, head_dim)).astype(
                 np.float32),
             query_cov=np.broadcast_to(np.eye(head_dim, dtype=np.float32),
                                       (layers, heads or kv_heads, head_dim, head_dim)))
    return str(path)


@pytest.fixture(scope="module")
def basis_file(tmp_path_factory):
    return random_basis(tmp_path_factory.mktemp("basis") / "random_basis.npz",
                        CONFIG.num_layers, CONFIG.num_kv_heads, CONFIG.head_dim, CONFIG.num_heads,
                        CONFIG.hidden_size)


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, CONFIG.vocab_size, n).tolist()


def is_codec(cache) -> bool:
    return any(isinstance(layer, ResidualCache)
               or (isinstance(layer, TokenCache) and is_encoded(layer.k)) for layer in cache)


def check_stores(cache) -> None:
    """Table cursors within their tables; every decoded key and value finite."""
    for i, layer in enumerate(cache):
        if not isinstance(layer, (TokenCache, ResidualCache)):
            continue  # a recurrent state (kvjax.policies.recurrent): no stores
        body = layer.body if isinstance(layer, ResidualCache) else layer
        for store in (body.k, body.v):
            if isinstance(store, PackedChannels):
                assert int(store.groups) <= store.table_rows, f"layer {i}: table overflow"
        dense = view(layer)
        assert np.isfinite(np.asarray(dense.k)).all() and np.isfinite(np.asarray(dense.v)).all()


def reference_attend(q, q_pos, cache, impl="xla", **kwargs):
    """Attention over a plain float32 cache holding the decoded keys and values."""
    dense = view(cache)  # stores decoded, residual parts joined: a TokenCache of arrays
    plain = TokenCache(k=jnp.asarray(dense.k, jnp.float32), v=jnp.asarray(dense.v, jnp.float32),
                       pos=dense.pos, length=dense.length, mass=dense.mass)
    return kvjax.attend_reference(q, q_pos, plain, **kwargs)


@contextlib.contextmanager
def attention_over_decoded_values():
    """While tracing, the model's `kvjax.attend` reads `view(cache)` as plain arrays."""
    attend = kvjax.attend
    kvjax.attend = reference_attend
    try:
        yield
    finally:
        kvjax.attend = attend


@functools.partial(jax.jit, static_argnames=("graphdef", "decoded"))
def one_step(graphdef, state, tokens, pos, cache, decoded: bool):
    """Logits [B, 1, V] of one step over `cache` (attention over its decoded values if `decoded`)."""
    model = nnx.merge(graphdef, state)
    with attention_over_decoded_values() if decoded else contextlib.nullcontext():
        return model(tokens, pos, cache)[0]


def step_equals_decoded_step(model, cache, tokens, next_pos, windowed=()) -> None:
    """One more step over `cache` gives the logits attention over its decoded values gives
    (`windowed` layers have no free slot by design: they make room by dropping the oldest)."""
    for i, layer in enumerate(cache):
        assert i in windowed or kvjax.free_tokens(layer) >= 1, \
            f"layer {i} has no room for one more token"
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray(tokens, jnp.int32)[:, None]
    pos = jnp.asarray(next_pos, jnp.int32)[:, None]
    encoded, decoded = (np.asarray(one_step(graphdef, state, tokens, pos, cache, decoded=d))
                        for d in (False, True))
    assert np.isfinite(encoded).all()
    # float32: the two paths differ only in summation order (blockwise softmax, latent-space
    # scores); |logits| of the tiny model are O(1), so 1e-4 is ~1000 float32 ulps
    np.testing.assert_allclose(encoded, decoded, atol=1e-4, rtol=1e-4)


def run_and_check(model, spec, prompts, every, **options):
    out = generate(model, prompts, max_new_tokens=MAX_NEW, transform=kvjax.parse_method(spec),
                   compress_every=every, eos_ids=(), **options)
    assert out.tokens.shape == (len(prompts), MAX_NEW)
    assert ((0 <= out.tokens) & (out.tokens < CONFIG.vocab_size)).all()
    check_stores(out.cache)
    if is_codec(out.cache):
        next_pos = [len(p) + MAX_NEW - 1 for p in prompts]  # the last drawn token is unwritten
        step_equals_decoded_step(model, out.cache, out.tokens[:, -1], next_pos)
    return out


def cases(extra: int = 0):
    """(prompts, generate options): the lengths alone and all of them in one batch (`extra`:
    slots the method writes beyond the tokens, RestoreKV's restore tokens).

    The short prompts alone share compiled programs: one capacity (134, the
    default of the 129-token prompt: below KIVI's window plus a group, so
    its exact part can never flush) and no `shrink`. The longest prompt
    alone and the mixed batch take the default path (capacity from the
    prompt, cut by `shrink` to the kept tokens), as the CLI does; the
    issue-21 tests below take it for short prompts.
    """
    for n in LENGTHS[:-1]:
        yield [prompt(n, n)], dict(capacity=max(LENGTHS[:-1]) + MAX_NEW + extra, shrink=False)
    yield [prompt(LENGTHS[-1], 0)], {}
    yield [prompt(n, n) for n in LENGTHS], {}


@pytest.mark.parametrize("every", [0, 2], ids=["prefill_only", "compress_every_2"])
@pytest.mark.parametrize("spec", SPECS)
def test_method_generates_on_every_prompt_length(model, basis_file, spec, every):
    prompt_only = spec in PROMPT_ONLY
    spec = spec.replace(BASIS, basis_file)
    failures = []
    for prompts, options in cases(RESTORE_TOKENS if spec.startswith("restorekv") else 0):
        if every and prompt_only:  # a clear refusal, never a silent other method
            with pytest.raises(ValueError, match="compress_every"):
                run_and_check(model, spec, prompts, every, **options)
            continue
        try:
            run_and_check(model, spec, prompts, every, **options)
        except Exception as e:  # collect every failing case, then fail with all of them
            failures.append(f"lengths {[len(p) for p in prompts]} {options}: "
                            f"{type(e).__name__}: {e}")
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------- issue 21 cases


def test_kivi_on_a_prompt_shorter_than_its_window(model):
    """Once `slice limit_indices must have every element be nonnegative` (a haiku prompt)."""
    out = generate(model, [prompt(5, 0)], max_new_tokens=4, transform=kvjax.kivi(bits=4))
    (layer, *_) = out.cache
    assert isinstance(layer, ResidualCache) and int(layer.body.length) == 0
    assert int(layer.recent.length) == 5 + 3  # every token exact: no group ever filled


def test_kivi_on_a_prompt_between_a_group_and_its_window(model):
    """Once `channel groups take 32 tokens at a time, got 2` (a ~60-token prompt)."""
    out = generate(model, [prompt(60, 1)], max_new_tokens=6, transform=kvjax.kivi(bits=4))
    assert all(int(layer.body.length) == 0 for layer in out.cache)


@pytest.mark.parametrize("spec", ["snapkv:ratio=0.5+kivi:bits=4", "kivi:bits=4+snapkv:ratio=0.5"])
def test_decode_time_compression_of_a_kivi_chain(model, spec):
    """Once `compact: capacity must be positive, got 0` (the body shrunk to no slots)."""
    out = generate(model, [prompt(150, 2)], max_new_tokens=6,
                   transform=kvjax.parse_method(spec), compress_every=2)
    assert out.tokens.shape == (1, 6)
    check_stores(out.cache)


def test_a_short_kivi_layer_without_shrink_is_a_plain_exact_cache():
    """A residual layer smaller than `residual + block` never flushes: its exact part
    holds what it has room for, and free_tokens counts exactly that room."""
    layer = write(init_cache(1, 2, 11, 32), jnp.ones((1, 2, 5, 32)), jnp.ones((1, 2, 5, 32)),
                  jnp.arange(5, dtype=jnp.int32)[None])
    (enc,), _ = kvjax.kivi(bits=2).update((layer,), (), None)
    assert flush_span(enc) == 0 and kvjax.free_tokens(enc) == 6
    for t in range(5, 11):  # fill it to the last slot
        enc = write(enc, jnp.full((1, 2, 1, 32), t, jnp.float32), jnp.zeros((1, 2, 1, 32)),
                    jnp.full((1, 1), t, jnp.int32))
    assert kvjax.free_tokens(enc) == 0 and int(enc.recent.length) == 11
    np.testing.assert_array_equal(np.asarray(enc.recent.pos[0, 0]), np.arange(11))
    np.testing.assert_array_equal(np.asarray(enc.recent.k[0, 5:, 0]), np.arange(5, 11))


def test_compact_of_a_residual_layer_with_an_empty_body():
    layer = write(init_cache(1, 2, 16, 32), jnp.ones((1, 2, 6, 32)), jnp.ones((1, 2, 6, 32)),
                  jnp.arange(6, dtype=jnp.int32)[None])
    (enc,), _ = kvjax.kivi(bits=2, group=4, residual=8).update((layer,), (), None)
    (small,) = kvjax.shrink((enc,), room=2)
    assert small.body.capacity == 0
    keep = jnp.arange(small.pos.shape[-1]) % 2 == 0
    out = kvjax.compact(small, jnp.broadcast_to(keep, small.pos.shape))
    assert out.body.capacity == 0
    np.testing.assert_array_equal(np.asarray(out.recent.pos[0, 0, :3]), [0, 2, 4])


@pytest.mark.slow
def test_cli_kivi_haiku_on_the_real_model(capsys):
    from experiments.cli.main import main
    from tests.conftest import smollm2_path
    code = main(["generate", "--model", str(smollm2_path()), "--chat", "--prompt",
                 "Write a haiku.", "--method", "kivi:bits=4", "--max-new-tokens", "8"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.strip()
