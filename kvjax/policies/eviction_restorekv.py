"""RestoreKV (kvpress RestoreKVPress): KVzip's eviction, plus a few learned restore tokens that
read the whole context before it goes.

RestoreKV (arXiv 2608.01247) scores the prefilled context as KVzip does (context
reconstruction, `eviction_kvzip`), then, before evicting, feeds `n` learned restore
embeddings (no token ids: vectors at the residual stream's start) at the positions after the
context, in one pass of the model with a LoRA adapter on, over the full cache. Their keys
and values join the cache; the adapter is off for everything after. The eviction is KVzip's
with the restore slots kept and not ranked, and as many more context tokens evicted as they
fill, so the cache holds what KVzip alone would (budget-matched): kvpress evicts
`int(N * min(1, ratio + n / T))` of the N context tokens (every layer's and KV head's; T the
context's length). Later tokens continue at the position after the restore tokens.

Only the restore embeddings and the adapter are trained, by self-distillation from the full
cache (`models.restorekv.train_restorekv`, `kvjax calibrate --restorekv`); kvpress downloads
the paper's for two 8B models. This module holds what the policy needs: the trained arrays
(`RestoreTokens`, saved with orbax) and the transform. The pass itself runs the model
(`models.restorekv.restore_pass`; `models.sampler.prefill_and_compress` calls it after the
reconstruction pass for a transform whose `Reconstruction` carries `restore`).

Example:
    >>> import numpy as np
    >>> tokens = RestoreTokens(np.zeros((8, 64), np.float32),
    ...                        {"v_proj": np.zeros((2, 64, 4), np.float32)},
    ...                        {"v_proj": np.zeros((2, 4, 32), np.float32)}, alpha=16.0)
    >>> t = restorekv(ratio=0.5, adapter=tokens, prompt="bare")
    >>> t.stats.reconstruction.restore.n, t.update.restored
    (8, 8)
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np

from kvjax.core.transforms import CacheTransform
from kvjax.policies.eviction import ByContent
from kvjax.policies.eviction_kvzap import restore_arrays
from kvjax.policies.eviction_kvzip import reconstruction_policy

# the projections a LoRA target names, as `models.lora.TARGETS` spells them
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True, eq=False)
class RestoreTokens(ByContent):
    """RestoreKV's trained arrays (float32 numpy): the restore embeddings and the LoRA adapter
    of the restore pass (`models.lora`'s convention: layer l's projection W becomes
    `W + (alpha / r) A_l B_l`). Hashed by content: it keys compilation through the
    `Reconstruction` of the transform's `StatsSpec`."""

    embeddings: np.ndarray  # [n, hidden]
    lora_a: dict  # target -> [L, d_in, r]
    lora_b: dict  # target -> [L, r, d_out]
    alpha: float = 16.0

    def __post_init__(self):
        e = self.embeddings
        if not (isinstance(e, np.ndarray) and e.dtype == np.float32 and e.ndim == 2
                and e.shape[0] >= 1 and np.isfinite(e).all()):
            raise ValueError(f"RestoreTokens: embeddings must be a finite float32 [n >= 1, "
                             f"hidden] array, got {getattr(e, 'dtype', type(e).__name__)} "
                             f"{getattr(e, 'shape', '')}")
        if not self.lora_a or set(self.lora_a) != set(self.lora_b) or \
                not set(self.lora_a) <= set(LORA_TARGETS):
            raise ValueError(f"RestoreTokens: lora_a and lora_b need the same targets among "
                             f"{list(LORA_TARGETS)}, got {sorted(self.lora_a)} and "
                             f"{sorted(self.lora_b)}")
        ranks = set()
        for t in self.lora_a:
            a, b = self.lora_a[t], self.lora_b[t]
            if not all(isinstance(x, np.ndarray) and x.dtype == np.float32 and x.ndim == 3
                       and np.isfinite(x).all() for x in (a, b)) or \
                    a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
                raise ValueError(f"RestoreTokens: {t} needs finite float32 A [L, d_in, r] and B "
                                 f"[L, r, d_out], got {getattr(a, 'shape', a)} and "
                                 f"{getattr(b, 'shape', b)}")
            ranks.add(a.shape[2])
        if len(ranks) != 1 or 0 in ranks:
            raise ValueError(f"RestoreTokens: every target needs the same rank >= 1, got "
                             f"{sorted(ranks)}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha)
                and self.alpha > 0):
            raise ValueError(f"RestoreTokens: alpha must be a finite number > 0, got "
                             f"{self.alpha!r}")

    @property
    def n(self) -> int:
        """How many restore tokens the pass writes."""
        return self.embeddings.shape[0]

    @property
    def num_layers(self) -> int:
        return next(iter(self.lora_a.values())).shape[0]

    def check_model(self, num_layers: int, hidden_size: int) -> None:
        """ValueError unless these arrays were made for a model of this shape."""
        got = (self.num_layers, self.embeddings.shape[1])
        if got != (num_layers, hidden_size):
            raise ValueError(f"restorekv: the adapter is for a model of {got[0]} layers and "
                             f"hidden size {got[1]}; this model has {num_layers} and "
                             f"{hidden_size}: train its own with `kvjax calibrate --restorekv "
                             f"--out DIR`")

    def save(self, path: str | os.PathLike) -> None:
        """Write the arrays as an orbax checkpoint at `path` (a new directory), which
        `restorekv:adapter=DIR` and `load_restore_tokens` read."""
        import orbax.checkpoint as ocp
        arrays = {"embeddings": self.embeddings, "alpha": np.float32(self.alpha),
                  **{f"a_{t}": a for t, a in self.lora_a.items()},
                  **{f"b_{t}": b for t, b in self.lora_b.items()}}
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(Path(path).absolute(), arrays)
        checkpointer.wait_until_finished()


def load_restore_tokens(path: str | os.PathLike) -> RestoreTokens:
    """The `RestoreTokens` saved at `path` (`RestoreTokens.save`, `kvjax calibrate
    --restorekv`); a ValueError naming the path when it is not such a checkpoint."""
    arrays = restore_arrays(path, "restorekv", "adapter")
    targets = sorted(k[2:] for k in arrays if k.startswith("a_"))
    expected = {"embeddings", "alpha"} | {f"{s}_{t}" for t in targets for s in "ab"}
    if not targets or set(arrays) != expected:
        raise ValueError(f"restorekv: adapter={str(path)!r} holds {sorted(arrays)}, not "
                         f"embeddings, alpha and a_T, b_T per LoRA target T")
    f32 = lambda x: np.asarray(x, np.float32)
    return RestoreTokens(f32(arrays["embeddings"]), {t: f32(arrays[f"a_{t}"]) for t in targets},
                         {t: f32(arrays[f"b_{t}"]) for t in targets},
                         float(arrays["alpha"]))


def restorekv(ratio: float | None = None,
              adapter: str | os.PathLike | RestoreTokens | None = None, n_sink: int = 4,
              layerwise: bool = False, chunk_size: int = 2048, prompt: str = "chat",
              plus: bool = False) -> CacheTransform:
    """RestoreKV: KVzip (`eviction_kvzip.kvzip`, the same arguments) with learned restore
    tokens written before the eviction, which fill part of the same budget; kvpress
    `RestoreKVPress(compression_ratio=ratio, layerwise, n_sink, chunk_size,
    kvzip_plus_normalization=plus)` with `adapter`'s embeddings and LoRA in place of the
    hub's.

    `adapter`: a `RestoreTokens` or the orbax directory `kvjax calibrate --restorekv --out DIR`
    writes (made for the model it runs with: checked when the pass runs)."""
    if adapter is None:
        raise ValueError("restorekv: needs adapter=DIR, the restore embeddings and LoRA that "
                         "`kvjax calibrate --restorekv --out DIR` trains for the model")
    tokens = adapter if isinstance(adapter, RestoreTokens) else load_restore_tokens(adapter)
    return reconstruction_policy("restorekv", ratio, n_sink, layerwise, chunk_size, prompt,
                                 False, plus, restore=tokens)
