"""What the GPU kernel costs per loop step, read from the compiler instead of a GPU.

For each page format (and launch config) this lowers kvjax's GPU paged
attention for CUDA on this host, takes the Triton IR out of the
`__gpu$xla.gpu.triton` custom call, compiles it for an H100/H200 (sm_90a) with
the `triton` package's own compiler and `ptxas` (no GPU needed), and reads:

  * registers per thread and spill bytes (`ptxas -v`), shared memory per
    program, and so how many programs fit on one multiprocessor (65,536
    registers, 228 KB of shared memory, 64 warps);
  * the SASS of the main loop (the longest backward branch, `nvdisasm`): its
    instructions per warp, times the warps, is the warp-instructions one loop
    step issues; beside the bytes a step reads, that is the issue cost per
    byte, which bounds a format's speed when it is not memory-bound;
  * the loop's opcode histogram (global loads, cp.async copies, shared-memory
    round trips, barriers, tensor-core ops, conversions).

A static proxy, not a timing: the `triton` package here is not the Triton
that XLA bundles on a GPU machine, and nothing is run. Use it to compare
kernel variants between GPU runs; time them with `experiments/bench/kernels.py`.
Needs `pip install triton` (Linux x86-64; any 3.x whose parser reads the IR).

    python -m experiments.bench.triton_static --out docs/bench/triton_static.json
    python -m experiments.bench.triton_static --formats int4 --launch 0 4x1 8x2
    python -m experiments.bench.triton_static --kernels OLD   # OLD/kernels_pallas: an A/B
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import tempfile
from pathlib import Path

import jax

from experiments.bench import kernels as bench
from kernels_pallas.gpu_lowering import _triton, compile_sm90, triton_modules
from kernels_pallas.paged_attention import paged_attention


def analyse(shape_name: str, fmt_name: str, launch, page_size: int = 64) -> dict:
    """One format's kernel at Llama-style decode (one 64-slot page a loop step by default)."""
    shape = bench.SHAPES[shape_name]
    kvh, d = shape["kv_heads"], shape["head_dim"]
    q, q_pos, pos, tables, counts, plane = bench.make_layout(jax.random.key(0), 2, 1024,
                                                             page_size, shape)
    kf, vf = bench.formats(fmt_name, page_size, d)
    k = bench.random_pages(jax.random.key(1), kf, fmt_name, kvh * plane, page_size, d)
    v = bench.random_pages(jax.random.key(2), vf, fmt_name if vf is kf else "v", kvh * plane,
                           page_size, d)
    fn = functools.partial(paged_attention, backend="gpu", k_format=kf, v_format=vf,
                           head_stride=plane, launch=launch)
    (ttir, config), = triton_modules(fn, q, q_pos, k, v, pos, tables, counts)
    with tempfile.TemporaryDirectory() as tmp:
        stats = compile_sm90(ttir, config["num_warps"], config["num_stages"], Path(tmp))
    read = bench.per_page_bytes((k, v)) + page_size * 4  # one page of keys, values, positions
    return dict(shape=shape_name, format=fmt_name, **config, step_bytes=read,
                warp_instructions_per_kb=round(stats["loop_warp_instructions"] / read * 1024, 1),
                **stats)


def use_kernels_from(directory: str) -> None:
    """Analyse `directory`/kernels_pallas (an earlier kernel, e.g. `git show` of an older
    commit) instead of the installed one: an A/B of two kernel versions by the same reading."""
    global bench, paged_attention
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, str(Path(directory).resolve()))
    for name in [m for m in sys.modules
                 if m.split(".")[0] == "kernels_pallas" or m == "experiments.bench.kernels"]:
        del sys.modules[name]
    bench = importlib.import_module("experiments.bench.kernels")
    paged_attention = importlib.import_module("kernels_pallas.paged_attention").paged_attention
    found = importlib.import_module("kernels_pallas").__file__
    if not found.startswith(str(Path(directory).resolve())):
        raise SystemExit(f"--kernels {directory}: kernels_pallas still imports from {found}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["llama3-8b"], choices=list(bench.SHAPES))
    parser.add_argument("--formats", nargs="+", default=["bf16", "fp8", "int8", "int4", "kivi4"],
                        choices=list(bench.FORMATS))
    parser.add_argument("--launch", type=bench.launch_arg, nargs="+", default=[None],
                        help="WARPSxSTAGES; 0 = the kernel's default")
    parser.add_argument("--kernels", default=None,
                        help="a folder holding an earlier kernels_pallas to analyse instead")
    parser.add_argument("--out", default=None, help="JSON file")
    args = parser.parse_args(argv)
    if args.kernels:
        use_kernels_from(args.kernels)
    triton, _, _ = _triton()  # fail early, with the package's name
    rows = []
    for shape in args.shapes:
        for fmt in args.formats:
            for launch in args.launch:
                rows.append(analyse(shape, fmt, launch))
                r = rows[-1]
                print(f"{shape} {fmt} warps={r['num_warps']} stages={r['num_stages']}: "
                      f"{r['registers']} regs, {r['spill_bytes']} B spilled, "
                      f"{r['shared_bytes']} B shared, {r['programs_per_sm']} programs/SM, "
                      f"loop {r['loop_warp_instructions']} warp-instr for {r['step_bytes']} B "
                      f"({r['warp_instructions_per_kb']}/KB)", flush=True)
    if args.out:
        meta = {**bench.environment(), "triton": triton.__version__, "target": "sm_90a",
                "kernels": args.kernels or "installed",
                "command": "python -m experiments.bench.triton_static " +
                " ".join(sys.argv[1:] if argv is None else argv)}
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
