"""What a GPU kernel is given and what it costs, read on a host without a GPU.

- `triton_modules(fn, *args)`: the Triton IR (`tt` dialect) of every Pallas
  Triton kernel `jax.jit(fn)` lowers to for CUDA, with its launch config: what
  tests assert on (dot operand types, load shapes).
- `compile_sm90(ttir, num_warps, num_stages, workdir)`: that IR compiled for an
  H100/H200 (sm_90a) by the `triton` package's compiler and `ptxas`, read back as
  registers, spills, shared memory, programs per multiprocessor and the main loop's
  SASS opcodes (`loop_opcodes`). Needs `pip install triton` (not a dependency); a
  static proxy for time, not a timing (`experiments/bench/triton_static.py`).

Like `tpu_compile` for TPUs: the real compiler, no device.

Example:
    >>> import functools
    >>> import jax.numpy as jnp
    >>> from kernels_pallas.paged_attention import paged_attention
    >>> q, k = jnp.ones((1, 1, 4, 64), jnp.bfloat16), jnp.ones((2, 16, 64), jnp.bfloat16)
    >>> pos, tables = jnp.arange(32).reshape(2, 1, 16), jnp.array([[[0, 1]]], jnp.int32)
    >>> args = (q, jnp.array([[31]]), k, k, pos, tables, jnp.array([[2]], jnp.int32))
    >>> (ttir, launch), = triton_modules(functools.partial(paged_attention, backend="gpu"), *args)
    >>> "tt.dot" in ttir, launch
    (True, {'num_warps': 4, 'num_stages': 2})
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
from pathlib import Path

import jax

SM90 = dict(registers=65536, shared=228 * 1024, warps=64)


def cuda_custom_calls(fn, *args, target: str) -> list:
    """The `stablehlo.custom_call` ops whose target names `target` ("triton", "mosaic_gpu")
    in what `jax.jit(fn)(*args)` lowers to for CUDA, in program order."""
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    found = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    if (child.operation.name == "stablehlo.custom_call" and target in
                            str(child.attributes["call_target_name"])):
                        found.append(child)
                    walk(child.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    return found


def triton_modules(fn, *args) -> list[tuple[str, dict]]:
    """(Triton IR text, launch config) of every Triton kernel `jax.jit(fn)` lowers to for CUDA."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton.lowering import _new_ir_context
    out = []
    for call in cuda_custom_calls(fn, *args, target="triton"):
        config = call.attributes["mhlo.backend_config"]
        with _new_ir_context():
            text = str(ir.Module.parse(config["ir"].value_bytes))
        launch = {k: int(str(config[k]).split(":")[0]) for k in ("num_warps", "num_stages")}
        out.append((text, launch))
    return out


def _triton():
    """(the triton package, its GPUTarget, its compile), or a clear exit without it."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import compile as triton_compile
    except ImportError:
        raise SystemExit("compiling for sm_90a here needs the triton package: "
                         "pip install triton") from None
    return triton, GPUTarget, triton_compile


def _tool(name: str) -> str:
    triton, _, _ = _triton()
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_sm90(ttir: str, num_warps: int, num_stages: int, workdir: Path) -> dict:
    """Triton IR text -> PTX (Triton's compiler) -> cubin (ptxas): resources and loop SASS."""
    _, GPUTarget, triton_compile = _triton()
    src = workdir / "kernel.ttir"
    src.write_text(ttir)
    kernel = triton_compile(str(src), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = workdir / "kernel.ptx"
    ptx.write_text(kernel.asm["ptx"])
    cubin = workdir / "kernel.cubin"
    info = subprocess.run([_tool("ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o", str(cubin)],
                          capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", info).group(1))
    sass = subprocess.run([_tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    shared = kernel.metadata.shared
    fit = min(SM90["registers"] // max(regs * 32 * num_warps, 1),
              SM90["shared"] // max(shared, 1), SM90["warps"] // num_warps)
    loop = loop_opcodes(sass)
    return dict(registers=regs, spill_bytes=spills, shared_bytes=shared,
                programs_per_sm=fit, loop_instructions_per_warp=sum(loop.values()),
                loop_warp_instructions=sum(loop.values()) * num_warps,
                loop_opcodes=dict(loop.most_common()))


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcode counts (`LDG`, `HMMA`, ...) of the longest backward-branch span: the main loop."""
    instructions, labels = [], {}
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
        op = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);",
                      line)
        if op:
            instructions.append((op.group(1).split(".")[0], op.group(2)))
    spans = [(labels[t.group(1)], i) for i, (op, rest) in enumerate(instructions)
             if op == "BRA" and (t := re.search(r"(\.L_x_\d+)", rest))
             and labels.get(t.group(1), i) < i]
    start, end = max(spans, key=lambda s: s[1] - s[0], default=(0, len(instructions) - 1))
    return collections.Counter(op for op, _ in instructions[start:end + 1])
