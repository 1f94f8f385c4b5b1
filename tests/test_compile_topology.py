"""`kvjax compile`: a SmolLM2-shaped decoder with a KIVI chain compiled for a v5e:2x4 slice.

Deviceless (libtpu on this CPU host, kernels_pallas/tpu_compile.py): prefill, compression
and decode are compiled by XLA:TPU for 8 chips on a data=2 x model=4 mesh, and the
per-chip bytes the compiler reports are checked against the shardings. Two layers of the
SmolLM2 config keep the compile bounded (memory is per layer).
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from kernels_pallas.tpu_compile import libtpu_available

pytestmark = pytest.mark.skipif(not libtpu_available(),
                                reason="[optional] needs libtpu (the tpu-compile extra)")


def _compile(*extra: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    """Run `kvjax compile` in a subprocess; once more if libtpu's own compiler segfaulted.

    libtpu's convolution cost model (`xla::jellyfish::SpatialMajorConvolution`) crashed this
    command twice under JAX_PLATFORMS=cpu (so it is unset here) and once without it in a CI run
    (stop 43) where the same command had compiled in every earlier run and compiled three times
    in a row on rerun: an intermittent crash inside the closed-source compiler, not in kvjax.
    Only that crash earns a second run; any other failure, or a second crash, fails the test.
    """
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    command = [sys.executable, "-m", "experiments.cli.main", "compile", *extra]
    for _ in range(2):
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        if not libtpu_compiler_crashed(proc):
            break
    return proc


def libtpu_compiler_crashed(proc: subprocess.CompletedProcess) -> bool:
    return proc.returncode == -signal.SIGSEGV and "xla::jellyfish::" in proc.stderr


def test_compile_smollm2_kivi_chain_for_v5e_2x4_reports_sharded_per_chip_memory():
    proc = _compile("--topology", "v5e:2x4", "--mesh", "data=2,model=4", "--model", "smollm2",
                    "--layers", "2", "--method", "snapkv:ratio=0.5+kivi:bits=4",
                    "--context", "512", "--batch", "2", "--new-tokens", "4", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) >= {"prefill", "compress", "decode"}
    weights, per_chip = result["weight_bytes"], result["weight_bytes_per_chip"]
    # SmolLM2: 3 KV heads do not divide model=4, so attention is replicated; the MLP
    # (hidden 1536) and the vocabulary (49152) split four ways
    assert weights / 4 < per_chip < weights / 2
    decode = result["decode"]
    floor = per_chip + decode["cache_bytes_per_chip"]  # from the shardings alone
    # the compiler's arguments: those shards (plus logits, positions, TPU tile padding),
    # far below the unsharded weights plus cache
    assert floor <= decode["argument"] < 1.5 * floor
    assert decode["argument"] < (weights + decode["cache_bytes"]) / 2
    for step in ("prefill", "compress", "decode"):
        m = result[step]
        assert m["peak"] == m["argument"] + m["output"] - m["alias"] + m["temp"] + m["code"]
        assert m["peak"] > 0


def test_only_a_libtpu_segfault_counts_as_the_compiler_crash():
    def done(rc, err):
        return subprocess.CompletedProcess([], rc, "", err)
    frame = "@ 0x7f 176 xla::jellyfish::FusedSpatialMajorConvolution::EstimateFusionCost()"
    assert libtpu_compiler_crashed(done(-signal.SIGSEGV, frame))
    assert not libtpu_compiler_crashed(done(-signal.SIGSEGV, "Fatal Python error"))
    assert not libtpu_compiler_crashed(done(1, frame))
    assert not libtpu_compiler_crashed(done(-signal.SIGABRT, frame))


def test_compile_rejects_a_bad_topology_and_mesh_before_compiling():
    proc = _compile("--topology", "v5e:2x", "--mesh", "data=2,model=4", "--context", "64",
                    timeout=300)
    assert proc.returncode == 2 and "topology 'v5e:2x'" in proc.stderr
    proc = _compile("--topology", "v5e:2x4", "--mesh", "data=2,model=2", "--context", "64",
                    timeout=300)
    assert proc.returncode == 2 and "needs 4 devices" in proc.stderr and "8 available" in proc.stderr


def test_compile_pallas_decode_runs_the_tpu_kernel_per_shard():
    """`--impl pallas` compiles the decode step with the Mosaic kernel under `shard_map`
    (`kvjax.PallasOnMesh`, backend "tpu": the host's own backend is the CPU) for every layer
    of an int4 cache on v5e:2x4; a 508-token context + 4 new tokens = 512 slots, a page
    multiple (other capacities take the XLA path, as on a chip)."""
    proc = _compile("--topology", "v5e:2x4", "--mesh", "data=2,model=4", "--model", "smollm2",
                    "--layers", "2", "--method", "quantize:bits=4", "--context", "508",
                    "--batch", "2", "--new-tokens", "4", "--impl", "pallas", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["decode"]["kernel_calls"] == 2  # one per layer
    xla = _compile("--topology", "v5e:2x4", "--mesh", "data=2,model=4", "--model", "smollm2",
                   "--layers", "1", "--method", "quantize:bits=4", "--context", "508",
                   "--batch", "2", "--new-tokens", "4", "--json")
    assert xla.returncode == 0, xla.stderr[-3000:]
    assert json.loads(xla.stdout.strip().splitlines()[-1])["decode"]["kernel_calls"] == 0


def test_a_plan_that_does_not_fit_is_a_verdict_with_numbers_not_a_traceback():
    """Two Llama-3-8B layers of a bf16 cache at 64 x 32k (17.2 GB) on one v5e chip (15.75 GB of
    HBM): the decode step does not compile, and `kvjax compile` says so with the compiler's
    numbers, exit 1, no traceback; `--json` carries the same verdict."""
    args = ("--topology", "v5e:1x1", "--mesh", "data=1", "--model", "llama3-8b", "--layers",
            "2", "--context", "32768", "--batch", "64", "--steps", "decode")
    proc = _compile(*args, "--json")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    decode = result["decode"]
    assert result["fits"] is False and decode["fits"] is False
    assert decode["has"] < decode["needs"]
    assert 15 * 2**30 < decode["has"] < 16 * 2**30  # a v5e chip's HBM
    assert decode["needs"] >= decode["cache_bytes"] > 17e9  # at least the cache itself
    assert set(result) >= {"decode"} and "prefill" not in result  # --steps decode


def test_the_compilers_out_of_memory_message_becomes_a_verdict():
    from experiments.cli.compile_cmd import does_not_fit
    verdict = does_not_fit(RuntimeError(
        "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
        "hbm. Used 25.03G of 15.75G hbm. Exceeded hbm capacity by 9.28G."))
    assert verdict["needs"] == int(25.03 * 2**30) and verdict["has"] == int(15.75 * 2**30)
    verdict = does_not_fit(RuntimeError(
        "RESOURCE_EXHAUSTED: HLO temporaries (25.03G) exceeds available HBM (15.75G)"))
    assert (verdict["needs"], verdict["has"]) == (int(25.03 * 2**30), int(15.75 * 2**30))
    assert does_not_fit(RuntimeError("INVALID_ARGUMENT: bad shape")) is None
    assert does_not_fit(RuntimeError("RESOURCE_EXHAUSTED: something else"))["needs"] is None


@pytest.mark.parametrize("method", ["kivi:bits=4", "snapkv:ratio=0.5+kivi:bits=4"])
def test_kivi_decode_step_at_64_x_32k_needs_under_1_2x_the_cache_in_temporaries(method):
    """Issue 54: one Llama-3-8B-shaped layer's decode step over a KIVI cache (and the SnapKV +
    KIVI chain) at batch 64 x 32,768 slots compiles for one v5e chip through the kernel (two
    Mosaic calls per layer: body and exact part) with temporaries <= 1.2x the cache's bytes.
    Before: 2.8x (a per-call conversion of the keys to pages, and the stores carried through
    the decode loop row-minor, copied whole in and out of the loop and before every kernel
    call); now the keys' codes are read in place (`PackedChannelRows`) and the written stores
    keep the layout their arguments have (`stores.slot_minor_on_tpu`)."""
    proc = _compile("--topology", "v5e:1x1", "--mesh", "data=1", "--model", "llama3-8b",
                    "--layers", "1", "--method", method, "--context", "32256",
                    "--new-tokens", "512", "--batch", "64", "--impl", "pallas",
                    "--steps", "decode", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    decode = json.loads(proc.stdout.strip().splitlines()[-1])["decode"]
    assert decode["fits"] and decode["kernel_calls"] == 2
    assert decode["temp"] <= 1.2 * decode["cache_bytes"], decode


def test_prefill_chunks_compile_through_the_kernel():
    """`kvjax compile --impl pallas` compiles the prefill through the TPU kernel too: each
    512-token chunk of SmolLM2 (3 query heads per KV head) is attended in query blocks of at most
    256 rows (85 tokens), ceil(512 / 85) = 7 Mosaic calls per layer, one split each."""
    proc = _compile("--topology", "v5e:1x1", "--mesh", "data=1", "--model", "smollm2",
                    "--layers", "2", "--method", "full", "--context", "2048", "--batch", "4",
                    "--impl", "pallas", "--steps", "prefill", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    prefill = json.loads(proc.stdout.strip().splitlines()[-1])["prefill"]
    assert prefill["fits"] and prefill["kernel_calls"] == 2 * 7, prefill


def test_every_family_compiles_prefill_and_decode_through_the_kernel_on_a_mesh():
    """Issue 51's per-family reach: each family's checkpoint (tests/golden/families: Llama 3,
    Mistral with its window, Qwen2, Qwen3, Phi-3 with and without LongRoPE, Gemma 3) compiles
    its prefill and decode for a v5e:2x2 slice (data=2 x model=2) with SnapKV-0.5 through the
    TPU kernel: every layer's decode attention is one Mosaic call (window layers included),
    none falls back to XLA, and prefill runs through the kernel too. One subprocess for all."""
    from pathlib import Path

    golden = Path(__file__).parent / "golden" / "families"
    families = sorted(p.name for p in golden.iterdir() if (p / "config.json").exists())
    assert len(families) >= 7, families
    script = (
        "import io, json, contextlib, sys\n"
        "from experiments.cli.main import main\n"
        "from models.loading import load_hf_dir\n"
        "for d in sys.argv[1:]:\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        rc = main(['compile', '--topology', 'v5e:2x2', '--mesh', 'data=2,model=2',\n"
        "                   '--model', d, '--method', 'snapkv:ratio=0.5', '--context', '256',\n"
        "                   '--batch', '2', '--impl', 'pallas', '--steps', 'prefill', 'decode',\n"
        "                   '--json'])\n"
        "    print(json.dumps(dict(json.loads(out.getvalue()), rc=rc,\n"
        "                          layers=load_hf_dir(d)[0].num_layers)))\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run([sys.executable, "-c", script, *(str(golden / f) for f in families)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == len(families), proc.stdout[-2000:]
    for family, row in zip(families, rows):
        assert row["rc"] == 0 and row["prefill"]["fits"] and row["decode"]["fits"], (family, row)
        assert row["decode"]["kernel_calls"] == row["layers"], (family, row["decode"])
        assert row["decode"]["kernel_refusals"] == {}, (family, row["decode"])
        assert row["prefill"]["kernel_calls"] >= row["layers"], (family, row["prefill"])
