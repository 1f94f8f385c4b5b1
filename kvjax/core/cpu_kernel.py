"""A decode step's attention and batched matmuls on the CPU as hand-written kernels (XLA FFI).

XLA:CPU cannot fuse the decode of a packed cache block into the dot that reads
it, so `attend_blockwise` on a 4-bit KIVI cache decoded every block to float32
first and ran slower than over the full float32 cache (docs/DECISIONS.md). This
module builds `cpu_kernels/decode_attention.cc` with the machine's C++ compiler
on first use (cached per source, jax version and CPU under
`$XDG_CACHE_HOME/kvjax`), registers it with XLA, and continues
`attend_blockwise`'s running softmax over one cache part in one call: each
slot's keys and values are decoded into an L1-resident buffer and used at once,
on XLA's intra-op thread pool.

It serves decode steps (at most `MATVEC_ROWS` query rows per cache row) lowered for
the CPU (`lax.platform_dependent`: a TPU or GPU program lowered on a CPU host, as in a
deviceless compile, keeps the loop) in a process whose only device is a CPU (a GPU or
TPU host never builds it), for parts whose keys and values are each a dense
float32/bf16 array, a `PackedTokens` or a `PackedChannels` store. Everything
else, every multi-device run (a custom call would not be partitioned) and every
`jax.export` (`disabled()`) uses the XLA loop. `KVJAX_CPU_KERNEL=0` switches it
off; without a compiler it warns once and the XLA loop runs. `KVJAX_CPU_KERNEL_BUILD=background`
(`build_mode`) builds it in a detached process while this one runs the XLA loop.

The same library holds `matmul`, the weights' product for a decode step (1-8 rows):
XLA:CPU's GEMM call for a few rows cost about twice its one-row dot, and its one-row dot
compiles to a loop per weight; the kernel streams each weight once (same conditions: CPU, one
device, not under `disabled()`). `rms_norm` and `rope`, a decoder layer's element-wise glue,
are calls of it too: XLA:CPU compiled each norm and rotation to kernels of its own, most of
a decode program's compile time.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from kvjax import attend, init_cache, write
    >>> k, v = jax.random.normal(jax.random.key(0), (2, 1, 1, 40, 8))  # [B, KVH, T, D]
    >>> cache = write(init_cache(1, 1, 64, 8), k, v, jnp.arange(40)[None])
    >>> q = jax.random.normal(jax.random.key(1), (1, 1, 2, 8))
    >>> with disabled():
    ...     plain = attend(q, jnp.array([[39]]), cache)
    >>> bool(jnp.allclose(attend(q, jnp.array([[39]]), cache), plain, atol=1e-6))
    True
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


SOURCE = Path(__file__).with_name("cpu_kernels") / "decode_attention.cc"
TARGET = "kvjax_decode_attention"
MATMUL_TARGET = "kvjax_few_rows_matmul"
MATMUL_T_TARGET = "kvjax_few_rows_matmul_t"
NORM_TARGET = "kvjax_rms_norm"
ROPE_TARGET = "kvjax_rope"
QUANTIZE_TARGET = "kvjax_quantize_groups"
MATMUL_ROWS = (1, 8)
"""Rows `matmul` hands to the kernel: a decode step (one row: 8% faster than XLA's dot over
the model's weights on an AVX-512 Xeon, 0.82-0.99x its rate on an AVX2 EPYC, and 454 fewer
LLVM loops to compile; docs/DECISIONS.md, docs/BENCHMARKS.md)."""
FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros", "-std=c++17", "-shared", "-fPIC")
"""Compiler flags besides `-march` (`flags()`)."""
CHUNK = 512
"""Slots per work item: a row's slots are split into chunks so both cores share one row."""

_state = threading.local()


@contextlib.contextmanager
def switched_off(state: threading.local):
    """Set `state.off` inside the block: a thread-local switch that traced code reads."""
    before = getattr(state, "off", False)
    state.off = True
    try:
        yield
    finally:
        state.off = before


def disabled():
    """Trace with the XLA loop inside this block (exports, tests that compare the two)."""
    return switched_off(_state)


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        return next((line for line in text.splitlines() if line.startswith("flags")), text[:4096])
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvjax" / "cpu_kernels"


def flags() -> tuple[str, ...]:
    """The kernel's compiler flags: `FLAGS` for the CPU `$KVJAX_CPU_KERNEL_MARCH` names.

    The default `native` builds for this machine (AVX-512 where it has it); a GCC `-march`
    value such as `x86-64-v3` (AVX2) builds the code another machine would run, e.g. to test
    the AVX2 path on an AVX-512 machine (`tests/test_cpu_kernel.py`).

    >>> [f for f in flags() if f.startswith("-march=")] == [
    ...     "-march=" + os.environ.get("KVJAX_CPU_KERNEL_MARCH", "native")]
    True
    """
    march = os.environ.get("KVJAX_CPU_KERNEL_MARCH", "native")
    if not re.fullmatch(r"[a-z0-9][a-z0-9_.+-]*", march):
        raise ValueError(f"KVJAX_CPU_KERNEL_MARCH={march!r}: expected a GCC -march value "
                         f"such as native or x86-64-v3")
    return (f"-march={march}", *FLAGS)


def _digest(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _record(out: Path) -> Path:
    """The size-and-hash record written beside a built library (`NAME.so.json`)."""
    return out.with_name(out.name + ".json")


def verified(out: Path) -> tuple[bytes | None, str]:
    """(the library's bytes, "") when `out` matches its record's size and SHA-256, else
    (None, what is wrong). A cached binary is trusted only so: dlopen of a truncated one
    kills the process with SIGBUS."""
    record = _record(out)
    try:
        want = json.loads(record.read_text("utf-8"))
        if not isinstance(want, dict) or set(want) != {"size", "sha256"}:
            return None, f"its record {record.name} is not a size-and-hash record"
    except FileNotFoundError:
        return None, f"no record {record.name} of its size and hash"
    except (OSError, ValueError) as e:
        return None, f"its record {record.name} is unreadable ({e})"
    try:
        data = out.read_bytes()
    except OSError as e:
        return None, f"it is unreadable ({e})"
    got = _digest(data)
    if got["size"] != want["size"]:
        return None, f"it is {got['size']} bytes, its record says {want['size']}"
    if got["sha256"] != want["sha256"]:
        return None, "its SHA-256 differs from its record's"
    return data, ""


def library_path(cxx: str | None = None) -> Path:
    """Where the library built from this source, jax version, flags, compiler and CPU lives."""
    cxx = cxx or os.environ.get("CXX", "g++")
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), jax.__version__.encode(),
                                     " ".join(flags()).encode(), cxx.encode(),
                                     _cpu_id().encode()])).hexdigest()[:16]
    return _cache_dir() / f"decode_attention-{key}.so"


def build(cxx: str | None = None) -> Path:
    """Compile the kernel (once per source, jax version, compiler flags and CPU) -> the .so path.

    A cached library is reused only when its size and SHA-256 match the record written at
    its build (`verified`); otherwise it is rebuilt, with one notice line on stderr.
    """
    cxx = cxx or os.environ.get("CXX", "g++")
    out = library_path(cxx)
    if out.exists() or _record(out).exists():
        data, problem = verified(out)
        if data is not None:
            return out
        print(f"kvjax: rebuilding the CPU kernel {out}: {problem}", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    record = partial.with_name(partial.name + ".json")
    if os.environ.get("KVJAX_QUIET", "") in ("", "0"):  # a first run's longest silent step
        print(f"kvjax: building the CPU attention kernel with {cxx} (once per machine and jax "
              f"version, about a minute on 2 cores) into {out.parent}", file=sys.stderr,
              flush=True)
    try:
        subprocess.run([cxx, *flags(), f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o",
                        str(partial)], check=True, capture_output=True, text=True)
        record.write_text(json.dumps(_digest(partial.read_bytes())), encoding="utf-8")
        # atomic: concurrent builders (pytest -n 2) never see half a file; the library first,
        # so a reader between the two renames sees a stale record and rebuilds, never trusts
        os.replace(partial, out)
        os.replace(record, _record(out))
    finally:
        partial.unlink(missing_ok=True)
        record.unlink(missing_ok=True)
    return out


def _load(path: Path):
    """dlopen the verified bytes of `path`: from a private in-memory copy where the system
    has one (nobody can truncate it under the mapping), else from `path` itself."""
    data, problem = verified(path)
    if data is None:
        raise OSError(f"{path}: {problem}")
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("kvjax-cpu-kernel")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        _open_fds.append(fd)  # kept open: the library stays mapped for the process
        return ctypes.cdll.LoadLibrary(f"/proc/self/fd/{fd}")
    return ctypes.cdll.LoadLibrary(str(path))


_open_fds: list[int] = []


BUILD_MODES = ("wait", "background")
"""`$KVJAX_CPU_KERNEL_BUILD`: what a process whose kernel is not built yet does.
`wait` (the default: programs, tests and benchmarks trace the same code on every run) builds
it in the process, with a notice; `background` starts the build in a detached process and
traces XLA's loop meanwhile, so a first run is not held up (`kvjax generate` chooses it)."""


def build_mode() -> str:
    mode = os.environ.get("KVJAX_CPU_KERNEL_BUILD", "wait")
    if mode not in BUILD_MODES:
        raise ValueError(f"KVJAX_CPU_KERNEL_BUILD={mode!r}: expected one of {BUILD_MODES}")
    return mode


def _building_marker(out: Path) -> Path:
    return out.with_name(out.name + ".building")


def build_in_background() -> bool:
    """Start `build()` in a detached process unless the library is built or being built
    (a marker younger than 10 minutes); True if this call started one. Its output goes to
    `NAME.so.log` beside the library."""
    out = library_path()
    marker = _building_marker(out)
    if verified(out)[0] is not None:
        return False
    try:
        if time.time() - marker.stat().st_mtime < 600:
            return False
    except FileNotFoundError:
        pass
    out.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(os.getpid()), encoding="utf-8")
    code = ("import pathlib; from kvjax.core.cpu_kernel import build\n"
            "try:\n    build()\nfinally:\n"
            f"    pathlib.Path({str(marker)!r}).unlink(missing_ok=True)\n")
    with open(out.with_name(out.name + ".log"), "w", encoding="utf-8") as log:
        subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=log,
                         stderr=log, start_new_session=True,
                         env=dict(os.environ, KVJAX_QUIET="1", JAX_PLATFORMS="cpu"))
    if os.environ.get("KVJAX_QUIET", "") in ("", "0"):
        print(f"kvjax: building the CPU attention kernel in the background (once per machine "
              f"and jax version, about a minute on 2 cores) into {out.parent}; until it is "
              f"built, decode attention runs as XLA's loop", file=sys.stderr, flush=True)
    return True


@functools.cache
def registered() -> bool:
    """Build (or, in `background` mode, find built), load and register the kernel once per
    process; False (one warning) if it cannot be built, False without a warning while a
    background build runs (`build_mode`)."""
    if build_mode() == "background" and verified(library_path())[0] is None:
        build_in_background()
        return False
    try:
        library = _load(build())
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", "") or err
        warnings.warn(f"kvjax: the CPU decode-attention kernel could not be built ({detail}); "
                      f"decode attention runs as XLA's loop", RuntimeWarning, stacklevel=3)
        return False
    for target, symbol in ((TARGET, library.KvjaxDecodeAttention),
                           (MATMUL_TARGET, library.KvjaxFewRowsMatmul),
                           (MATMUL_T_TARGET, library.KvjaxFewRowsMatmulT),
                           (NORM_TARGET, library.KvjaxRmsNorm), (ROPE_TARGET, library.KvjaxRope),
                           (QUANTIZE_TARGET, library.KvjaxQuantizeGroups)):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(symbol), platform="cpu")
    return True


def _format(store) -> dict | None:
    """The kernel's description of one key or value store, or None if it does not read it."""
    if isinstance(store, jax.Array):
        if store.dtype not in (jnp.float32, jnp.bfloat16):
            return None
        return dict(format=0, bits=0, group=0, symmetric=False,
                    arrays=(store, None, None, None))
    # kvjax.core.stores marks its packed stores (PackedTokens 1, PackedChannels 2): read by attribute,
    # since the stores call this module's quantization (an import either way would be a cycle)
    kind = getattr(store, "kernel_format", None)
    if kind == 1 and store.scale.dtype in (jnp.float16, jnp.uint16, jnp.bfloat16, jnp.float32):
        return dict(format=kind, bits=store.bits, group=store.group,
                    symmetric=store.offset is None,
                    arrays=(store.words, None, store.scale, store.offset))
    if kind == 2:
        # the table as [R, NG, L], in place; a uint32 table (a 16-bit scale and offset per word)
        # names the halves' dtype by an empty array in the unused offset slot (a bitcast to
        # them XLA:CPU compiled as a copy of the table every call)
        halves = jnp.zeros((0,), store.param_dtype) if store.table.dtype == jnp.uint32 else None
        return dict(format=kind, bits=store.bits, group=store.group, symmetric=store.symmetric,
                    arrays=(store.words, store.group_id, store.table_by_group(), halves))
    return None


def usable(part) -> bool:
    """Whether a decode step's attention over `part` (a TokenCache) can run in the kernel.

    The caller decides what a decode step is (`attend_blockwise`: at most
    `MATVEC_ROWS` query rows per kv head).
    """
    if any(jax.export.is_symbolic_dim(d) for d in part.pos.shape):
        return False
    return _format(part.k) is not None and _format(part.v) is not None and _available()


def attend_part(qg: jax.Array, mask: jax.Array, part, carry, *, scale: float,
                softcap: float | None, exact_dtype: bool = True):
    """Continue the running softmax `carry` = (m [R, Q], l [R, Q], acc [R, Q, D]) over `part`.

    `qg` [R, Q, D] (grouped queries), `mask` [R, Q, C] (visible slots); the same
    result as `attend_blockwise`'s loop over the part, within float32 rounding.
    `exact_dtype`: dense bf16 values are weighted in bf16 (weights rounded to
    bf16, as the loop's bf16 dot); False reads them as float32 (a residual
    layer's exact part).
    """
    k, v = _format(part.k), _format(part.v)
    empty = jnp.zeros((0,), jnp.float32)
    arrays = [empty if a is None else a for a in k["arrays"] + v["arrays"]]
    m, l, acc = carry
    call = jax.ffi.ffi_call(
        TARGET, (jax.ShapeDtypeStruct(m.shape, jnp.float32),
                 jax.ShapeDtypeStruct(l.shape, jnp.float32),
                 jax.ShapeDtypeStruct(acc.shape, jnp.float32)))
    return call(qg.astype(jnp.float32), mask, m, l, acc, jnp.asarray(part.length, jnp.int32),
                *arrays,
                k_format=np.int64(k["format"]), k_bits=np.int64(k["bits"]),
                k_group=np.int64(k["group"]), k_symmetric=k["symmetric"],
                v_format=np.int64(v["format"]), v_bits=np.int64(v["bits"]),
                v_group=np.int64(v["group"]), v_symmetric=v["symmetric"],
                scale=np.float32(scale), softcap=np.float32(softcap or 0.0),
                round_p=exact_dtype and isinstance(part.v, jax.Array)
                and part.v.dtype == jnp.bfloat16,
                chunk=np.int64(CHUNK))


def _runs_here() -> bool:
    """Whether a program traced now may call the kernels (see the module docstring)."""
    if getattr(_state, "off", False) or os.environ.get("KVJAX_CPU_KERNEL", "1") == "0":
        return False
    return jax.default_backend() == "cpu" and jax.device_count() == 1


def _available() -> bool:
    """`_runs_here()`, and the kernel built and registered (on the first call that asks)."""
    return _runs_here() and registered()


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N] in w's dtype (float32 or bf16), accumulated and returned in float32.

    A decode step's few rows (`MATMUL_ROWS`, concrete shapes) on the CPU run in the
    kernel, which streams w once (XLA:CPU's GEMM call for 2-8 rows cost about twice its one-row
    dot, docs/DECISIONS.md); everything else is `jnp.dot`. Equal to the dot within float32
    rounding (the sums are ordered differently).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x, w = jax.random.normal(jax.random.key(0), (3, 64)), jnp.ones((64, 32))
        >>> bool(jnp.allclose(matmul(x, w), x @ w, atol=1e-5))
        True
    """
    return matmuls(x, (w,))[0]


def matmuls(x: jax.Array, ws) -> tuple[jax.Array, ...]:
    """`matmul(x, w)` for each w of `ws` (all [K, N_i] of one dtype) in one kernel call: a
    layer's q, k and v products share one round of the thread pool.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x = jax.random.normal(jax.random.key(0), (1, 64))
        >>> q, k = matmuls(x, (jnp.ones((64, 32)), jnp.ones((64, 16))))
        >>> q.shape, k.shape, bool(jnp.allclose(k, x @ jnp.ones((64, 16)), atol=1e-5))
        ((1, 32), (1, 16), True)
    """
    dot = lambda x, w: jnp.dot(x.astype(w.dtype), w, preferred_element_type=jnp.float32)
    ws = tuple(ws)
    if not ws:
        raise ValueError("matmuls: ws must hold at least one weight, got none")
    same = all(w.ndim == 2 and w.dtype == ws[0].dtype for w in ws)
    if not same:
        return tuple(dot(x, w) for w in ws)
    return _few_rows(MATMUL_TARGET, x, ws, [w.shape[1] for w in ws], dot)


def matmul_t(x: jax.Array, w: jax.Array, otherwise=None) -> jax.Array:
    """x [..., K] @ w [N, K].T in w's dtype, in float32: `matmul` for a weight stored by rows of
    its outputs (a tied embedding's logits), read in place -- no transpose of w.

    `otherwise(x, w)` computes it where the kernel does not serve (default: the einsum).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x, w = jax.random.normal(jax.random.key(0), (2, 64)), jnp.ones((40, 64))
        >>> bool(jnp.allclose(matmul_t(x, w), x @ w.T, atol=1e-5))
        True
    """
    dot = otherwise or (lambda x, w: jnp.einsum("...k,nk->...n", x.astype(w.dtype), w,
                                                  preferred_element_type=jnp.float32))
    if w.ndim != 2:
        return dot(x, w)
    return _few_rows(MATMUL_T_TARGET, x, (w,), [w.shape[0]], dot)[0]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x * rsqrt(mean(x**2, -1) + eps) * weight in float32 (x [..., K] float32, weight [K]
    float32 or bf16): one kernel call on the CPU, which compiles in microseconds where XLA:CPU
    compiles each norm to kernels of its own (~15 ms each, twice per decoder layer and
    program: docs/DECISIONS.md); `jnp` elsewhere. Equal within float32 rounding (the squares
    are summed in another order).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x = jax.random.normal(jax.random.key(0), (3, 64))
        >>> plain = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * 2.0
        >>> bool(jnp.allclose(rms_norm(x, jnp.full(64, 2.0), 1e-5), plain, rtol=1e-6))
        True
    """
    def plain(x, weight):
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
        return x * weight.astype(jnp.float32)

    concrete = all(isinstance(d, int) for d in x.shape)
    if (x.dtype != jnp.float32 or weight.shape != x.shape[-1:] or not concrete or not x.size
            or weight.dtype not in (jnp.float32, jnp.bfloat16) or not _available()):
        return plain(x, weight)
    call = jax.ffi.ffi_call(NORM_TARGET, jax.ShapeDtypeStruct((x.size // x.shape[-1], x.shape[-1]),
                                                              jnp.float32))
    kernel = lambda x, w: call(x.reshape(-1, x.shape[-1]), w, eps=np.float32(eps)).reshape(x.shape)
    # picked when lowering: a TPU or GPU program (deviceless compile) keeps the jnp norm
    return jax.lax.platform_dependent(x, weight, cpu=kernel, default=plain)


def rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """`x` [B, T, N, D] rotated by `positions` [B, T] (the rotate-half convention: the pair
    `(x_i, x_{i+D/2})` turned by `positions * inv_freq[i]`), float32: one kernel call on the
    CPU (XLA:CPU compiles each rotation to kernels of its own: docs/DECISIONS.md), `jnp`
    elsewhere. Equal within float32 rounding of the sines and cosines.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> x = jax.random.normal(jax.random.key(0), (1, 3, 2, 8))
        >>> y = rope(x, jnp.array([[0, 1, 2]]), np.array([1.0, 0.5, 0.1, 0.01], np.float32))
        >>> bool(jnp.allclose(y[:, 0], x[:, 0]))               # position 0: not turned
        True
        >>> bool(jnp.allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1)))
        True
    """
    def plain(x, positions):
        angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
        cos = jnp.cos(angles)[:, :, None, :]
        sin = jnp.sin(angles)[:, :, None, :]
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    concrete = all(isinstance(d, int) for d in x.shape)
    if (x.ndim != 4 or positions.shape != x.shape[:2] or inv_freq.shape != (x.shape[-1] // 2,)
            or not jnp.issubdtype(positions.dtype, jnp.integer) or x.shape[-1] % 2
            or not concrete or not _available()):
        return plain(x, positions)
    b, t, n, d = x.shape
    call = jax.ffi.ffi_call(ROPE_TARGET, jax.ShapeDtypeStruct((b * t, n, d), jnp.float32))
    kernel = lambda x, positions: call(
        x.astype(jnp.float32).reshape(b * t, n, d), positions.astype(jnp.int32).reshape(b * t),
        jnp.asarray(inv_freq, jnp.float32)).reshape(b, t, n, d)
    # picked when lowering: a TPU or GPU program (deviceless compile) keeps the jnp rotation
    return jax.lax.platform_dependent(x, positions, cpu=kernel, default=plain)


def quantize_packed(x: jax.Array, bits: int, group: int, axis: int, symmetric: bool,
                    param_dtype, otherwise,
                    valid: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """`x` quantized in groups of `group` along `axis` and packed along its last axis:
    (words [..., D * bits / 32] uint32, scale, offset or None (symmetric)), bit for bit
    `otherwise(x)` -- `kvjax.core.quant.quantize(x, bits, group, axis, ..., valid=...)` and `pack`
    -- in one kernel call on the CPU; `otherwise` elsewhere. `axis=-1`: per token, x [..., D]
    (an int8 cache's or KIVI's values), params [..., D / group]; `axis=1`: per channel, x
    [R, T, D] (KIVI's keys) with `valid` [R, T] or None, params [R, T / group, D]. XLA:CPU
    compiled each quantization to ~8 kernels of its own: an int8 decode step, 60 of them,
    compiled 2.8x longer than the full cache's (docs/DECISIONS.md).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from kvjax.core.quant import pack, quantize
        >>> def plain(x):
        ...     q = quantize(x, 4, 32, axis=-1, param_dtype=jnp.float16)
        ...     return pack(q.codes, 4), q.scale, q.offset
        >>> x = jax.random.normal(jax.random.key(0), (3, 64))
        >>> got = quantize_packed(x, 4, 32, -1, False, jnp.float16, plain)
        >>> all(bool(jnp.array_equal(a, b)) for a, b in zip(got, plain(x)))
        True
    """
    param_dtype = jnp.dtype(param_dtype)
    concrete = all(isinstance(d, int) for d in x.shape)
    per_channel = axis in (1, -2) and x.ndim == 3
    if (not (axis == -1 and x.ndim >= 1 or per_channel) or not concrete or not x.size
            or bits not in (2, 4, 8) or group < 1 or x.shape[axis] % group
            or x.shape[-1] % (32 // bits) or x.dtype not in (jnp.float32, jnp.bfloat16)
            or (valid is not None and (not per_channel or valid.shape != x.shape[:2]))
            or param_dtype not in (jnp.float16, jnp.bfloat16, jnp.float32) or not _available()):
        return otherwise(x) if valid is None else otherwise(x, valid)
    d = x.shape[-1]
    params = (x.shape[0], x.shape[1] // group, d) if per_channel else (*x.shape[:-1], d // group)
    params = jax.ShapeDtypeStruct(params, param_dtype)
    call = jax.ffi.ffi_call(QUANTIZE_TARGET, (jax.ShapeDtypeStruct((*x.shape[:-1], d * bits // 32),
                                                                   jnp.uint32), params, params),
                            vmap_method="broadcast_all")
    no_mask = jnp.zeros((0,), bool)

    def kernel(x, valid=no_mask):
        groups_along = x if per_channel else x[..., None]  # [O, M, I], groups along M
        words, scale, offset = call(groups_along.astype(jnp.float32), valid, bits=np.int64(bits),
                                    group=np.int64(group), symmetric=symmetric)
        return words, scale, None if symmetric else offset

    # picked when lowering: a TPU or GPU program (deviceless compile) keeps `otherwise`
    args = (x,) if valid is None else (x, valid)
    return jax.lax.platform_dependent(*args, cpu=kernel, default=otherwise)


def _few_rows(target: str, x: jax.Array, ws: tuple, out_cols: list[int],
              dot) -> tuple[jax.Array, ...]:
    """`dot(x, w)` [..., out_cols[i]] per w, or one call of kernel `target` when it serves x's
    rows and every w (2-D float32 or bf16 of one dtype, `w.shape[1]` -- contiguous, read 16
    lanes at a time by both kernels -- a multiple of 16; see `matmul`)."""
    lead = x.shape[:-1]
    concrete = all(isinstance(d, int) for d in lead)
    rows = int(np.prod(lead)) if concrete else 0
    if (not MATMUL_ROWS[0] <= rows <= MATMUL_ROWS[1]
            or any(w.shape[1] % 16 for w in ws)
            or ws[0].dtype not in (jnp.float32, jnp.bfloat16) or not _available()):
        return tuple(dot(x, w) for w in ws)
    x_rows = x.reshape(rows, x.shape[-1]).astype(ws[0].dtype).astype(jnp.float32)  # as the dot sees it
    call = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct((rows, n), jnp.float32) for n in out_cols])
    kernel = lambda x_rows, *ws: tuple(y.reshape(*lead, y.shape[-1]) for y in call(x_rows, *ws))
    # picked when lowering: a TPU or GPU program (deviceless compile) keeps the dot
    return jax.lax.platform_dependent(x_rows, *ws, cpu=kernel,
                                      default=lambda x_rows, *ws: tuple(dot(x, w) for w in ws))
