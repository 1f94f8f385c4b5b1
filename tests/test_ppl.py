import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.eval.ppl import perplexity, sliding_windows
from models.llama import new_cache


def hf_style_nll(model, ids, context, stride):
    """The usual Hugging Face perplexity loop, one window at a time, in float64."""
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        window = jnp.asarray(ids[begin:end])[None]
        logits, _ = model(window, jnp.arange(end - begin)[None], new_cache(model.config, 1, end - begin))
        logp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32)), np.float64)
        trg = end - prev_end  # the last trg tokens of the window are new
        for j in range(max(end - begin - trg, 1), end - begin):
            nll -= logp[j - 1, ids[begin + j]]
            count += 1
        prev_end = end
        if end == len(ids):
            break
    return nll, count


@pytest.mark.parametrize("n, context, stride", [(50, 16, 8), (50, 16, 16), (37, 16, 5), (16, 16, 16)])
def test_perplexity_equals_direct_computation(tiny_model, n, context, stride):
    ids = np.random.default_rng(n + stride).integers(3, 250, n)
    got = perplexity(tiny_model, ids, context, stride, batch_size=3, chunk=8)
    nll, count = hf_style_nll(tiny_model, ids, context, stride)
    assert got.tokens_scored == count
    np.testing.assert_allclose(got.nll, nll, rtol=2e-5)
    np.testing.assert_allclose(got.ppl, np.exp(nll / count), rtol=2e-5)


def test_windows_score_every_token_but_the_first_once():
    for n, c, s in [(100, 10, 3), (100, 10, 10), (11, 10, 1), (2, 2, 1)]:
        windows = sliding_windows(n, c, s)
        scored = [t for w in windows for t in range(w.first_scored, w.end)]
        assert len(scored) == len(set(scored))
        assert all(w.end - w.start <= c and w.first_scored > w.start for w in windows)
        if s < c:  # overlapping windows give every token after the first context
            assert scored == list(range(1, n))


def test_bad_arguments_raise(tiny_model):
    with pytest.raises(ValueError, match="stride"):
        sliding_windows(10, 4, 5)
    with pytest.raises(ValueError, match="at least 2"):
        perplexity(tiny_model, [1], 4)


def direct_prefix_nll(model, ids, context, prefix):
    """Plain windows of `context` tokens; score window positions >= prefix (float64)."""
    nll, count = 0.0, 0
    for begin in range(0, len(ids) - 1, context):
        end = min(begin + context, len(ids))
        if end - begin <= prefix:
            break
        window = jnp.asarray(ids[begin:end])[None]
        logits, _ = model(window, jnp.arange(end - begin)[None], new_cache(model.config, 1, end - begin))
        logp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32)), np.float64)
        for j in range(prefix, end - begin):
            nll -= logp[j - 1, ids[begin + j]]
            count += 1
    return nll, count


@pytest.mark.parametrize("n, context, prefix", [(60, 20, 12), (45, 16, 5), (33, 16, 15)])
def test_prefix_perplexity_with_full_cache_scores_positions_after_the_prefix(tiny_model, n, context,
                                                                            prefix):
    ids = np.random.default_rng(n).integers(3, 250, n)
    got = perplexity(tiny_model, ids, context, batch_size=2, chunk=8, prefix=prefix)
    nll, count = direct_prefix_nll(tiny_model, ids, context, prefix)
    assert got.tokens_scored == count
    np.testing.assert_allclose(got.nll, nll, rtol=2e-5)


def test_prefix_perplexity_under_compression(tiny_model):
    import kvjax

    ids = np.random.default_rng(1).integers(3, 250, 64)
    full = perplexity(tiny_model, ids, 32, chunk=8, prefix=24)
    roomy = perplexity(tiny_model, ids, 32, chunk=8, prefix=24,
                       transform=kvjax.streaming_llm(sinks=2, window=30))  # evicts nothing
    np.testing.assert_allclose(roomy.nll, full.nll, rtol=1e-5)
    tight = perplexity(tiny_model, ids, 32, chunk=8, prefix=24, transform=kvjax.knorm(ratio=0.75))
    assert tight.tokens_scored == full.tokens_scored and np.isfinite(tight.nll)
    assert abs(tight.nll - full.nll) > 1e-3  # evicting 3/4 of the prefix changes predictions
    with pytest.raises(ValueError, match="prefix"):
        perplexity(tiny_model, ids, 32, transform=kvjax.knorm(ratio=0.5))
