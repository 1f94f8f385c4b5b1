"""Every file kvjax reads, damaged every way: one clear error naming the file, or a rebuild.

A table of file kinds x damages (truncated, empty, garbage of the same size, wrong schema).
Each case reads the damaged file the way kvjax does -- the `kvjax` command where one reads it
(`run-exported`, `generate --model DIR`, `$KVJAX_PLUGINS`), else the API a program calls
(`kvjax.tools.checkpoint.restore`) run through the command line's own error handling -- and must
end in exactly one `kvjax: error:` line that names the damaged file, exit status 2. A damaged
compiled CPU kernel (kvjax owns it) is rebuilt instead, with one notice line, in a fresh
process: never a traceback, never a signal (a truncated .so used to die of SIGBUS).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

import kvjax
from kvjax.tools import checkpoint

REPO = Path(__file__).resolve().parent.parent
TINY_HF = REPO / "tests" / "golden" / "tiny_hf" / "llama_tied"


def truncate(data: bytes) -> bytes:
    return data[:len(data) // 2]


def empty(data: bytes) -> bytes:
    return b""


def garbage(data: bytes) -> bytes:
    """As many bytes as before, none of them the same."""
    return bytes((b + 101) % 256 for b in data) or b"\x00garbage"


DAMAGES = {"truncate": truncate, "empty": empty, "garbage": garbage}


def cli_outcome(run) -> tuple[int, list[str]]:
    """(exit status, stderr lines) of `run()` handled as `kvjax`'s main handles a command's
    errors: FileNotFoundError, ValueError and OSError print one line, status 2. Anything
    else propagates (a traceback fails the test)."""
    import io
    from contextlib import redirect_stderr

    err = io.StringIO()
    with redirect_stderr(err):
        try:
            status = run()
        except (FileNotFoundError, ValueError, OSError) as e:
            print(f"kvjax: error: {e}", file=sys.stderr)
            status = 2
    return status, err.getvalue().splitlines()


def assert_one_error_naming(outcome, path: Path):
    status, lines = outcome
    errors = [line for line in lines if line.startswith("kvjax: error:")]
    assert status == 2 and len(errors) == 1, (status, lines[-5:])
    assert str(path) in errors[0] or path.name in errors[0], (str(path), errors[0])
    assert not any("Traceback" in line for line in lines), lines


# ----------------------------------------------------------------------------- artifacts


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, smollm2_tokenizer):
    """An exported tiny model (SmolLM2's vocabulary size, so its tokenizer fits)."""
    from flax import nnx
    from models.export import export_artifact
    from models.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig.tiny(vocab_size=49152, hidden_size=32, intermediate_size=64,
                                   num_heads=2, num_kv_heads=1, max_position=128),
                  rngs=nnx.Rngs(0))
    return export_artifact(model, smollm2_tokenizer, tmp_path_factory.mktemp("art") / "a",
                           max_len=64, chunk=16, buckets=(64,))


def run_exported(directory: Path):
    from experiments.cli import main as cli
    return cli.main(["run-exported", str(directory), "--prompt", "Hi <|im_start|>",
                     "--max-new-tokens", "2", "--json"])


def copy_artifact(artifact: Path, tmp_path: Path) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(artifact, out)
    return out


def test_a_healthy_artifact_runs(artifact, tmp_path, capsys):
    out = copy_artifact(artifact, tmp_path)
    assert run_exported(out) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(result["tokens"][0]) == 2


ARTIFACT_FILES = ["manifest.json", "functions/64/decode.jaxexport",
                  "functions/64/prefill.jaxexport", "weights.safetensors",
                  "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"]


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("name", ARTIFACT_FILES)
def test_damaged_artifact_file(artifact, tmp_path, name, damage, capsys):
    out = copy_artifact(artifact, tmp_path)
    path = out / name
    path.write_bytes(DAMAGES[damage](path.read_bytes()))
    status, lines = cli_outcome(lambda: run_exported(out))
    capsys.readouterr()
    assert_one_error_naming((status, lines), path)


def _edit_manifest(directory: Path, edit) -> Path:
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    return path


MANIFEST_EDITS = {
    "missing key": lambda m: m.pop("chunk"),
    "extra key": lambda m: m.update(surprise=1),
    "nonexistent bucket": lambda m: m.update(buckets=[64, 128]),
    "bucket without functions": lambda m: m["functions"].update({"32": {}}),
    "function outside the folder": lambda m: m["functions"]["64"].update(
        decode="../../../etc/passwd"),
    "wrong type": lambda m: m.update(buckets="64"),
    "float bucket": lambda m: m.update(buckets=[64.5]),
    "pad id out of range": lambda m: m.update(pad_id=10 ** 6),
    "file record missing": lambda m: m["files"].pop("weights.safetensors"),
    "wrong size record": lambda m: m["files"]["weights.safetensors"].update(size=5),
    "not an object": lambda m: m.clear() or m.update(kind="x"),
    "inv_freq of another head size": lambda m: m.update(inv_freq=m["inv_freq"][:-1]),
    "model without head_dim": lambda m: m["model"].pop("head_dim"),
    "bool chunk": lambda m: m.update(chunk=True),
}


@pytest.mark.parametrize("edit", MANIFEST_EDITS)
def test_artifact_manifest_with_the_wrong_schema(artifact, tmp_path, edit, capsys):
    out = copy_artifact(artifact, tmp_path)
    path = _edit_manifest(out, MANIFEST_EDITS[edit])
    status, lines = cli_outcome(lambda: run_exported(out))
    capsys.readouterr()
    named = out / "weights.safetensors" if edit == "wrong size record" else path
    if edit == "not an object":
        named = out  # "artifact kind 'x' format None; this kvjax reads ..."
    assert_one_error_naming((status, lines), named)


def test_a_missing_artifact_file_is_named(artifact, tmp_path, capsys):
    out = copy_artifact(artifact, tmp_path)
    (out / "functions/64/decode.jaxexport").unlink()
    assert_one_error_naming(cli_outcome(lambda: run_exported(out)),
                            out / "functions/64/decode.jaxexport")
    capsys.readouterr()


# ----------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    import jax

    cache = kvjax.init_model_cache(kvjax.CacheSpec(2, 1, 4), batch=1, capacity=8)
    cache = jax.tree.map(lambda x: x + 1 if x.dtype == np.float32 else x, cache)
    root = tmp_path_factory.mktemp("ckpt") / "c"
    checkpoint.save(root, cache, meta={"method": "full"})
    return root, cache


def _checkpoint_files(root: Path) -> list[str]:
    return sorted(str(f.relative_to(root)) for f in (root / "1").rglob("*") if f.is_file())


def test_a_healthy_checkpoint_restores(saved_checkpoint):
    import jax

    root, cache = saved_checkpoint
    again, meta = checkpoint.restore(root, expect={"method": "full"})
    assert meta == {"method": "full"}
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(again),
                                                    jax.tree.leaves(cache)))


@pytest.mark.parametrize("damage", ["truncate", "empty"])
def test_every_damaged_checkpoint_file_is_named(saved_checkpoint, tmp_path, damage):
    """Truncating or emptying any file of the step (array data, orbax metadata, the manifest,
    kvjax's size record) is one error naming that file or the checkpoint."""
    root, _ = saved_checkpoint
    for name in _checkpoint_files(root):
        copy = tmp_path / f"c-{damage}-{name.replace('/', '_')}"
        shutil.copytree(root, copy)
        path = copy / name
        path.write_bytes(DAMAGES[damage](path.read_bytes()))
        if not path.stat().st_size and damage == "truncate":
            continue  # a file of one byte is "empty" already
        status, lines = cli_outcome(lambda: checkpoint.restore(copy))
        assert status == 2, name
        assert_one_error_naming((status, lines), path if name != "1/kvjax-files.json"
                                else copy / name)


def test_garbage_checkpoint_files_error_or_restore_the_same_values(saved_checkpoint, tmp_path):
    """Garbage of the same size: an error naming the checkpoint, or (a file orbax does not
    read back) the very same arrays -- never different values."""
    import jax

    root, cache = saved_checkpoint
    for name in _checkpoint_files(root):
        copy = tmp_path / f"g-{name.replace('/', '_')}"
        shutil.copytree(root, copy)
        path = copy / name
        path.write_bytes(garbage(path.read_bytes()))
        try:
            again, _ = checkpoint.restore(copy)
        except (ValueError, FileNotFoundError) as e:
            assert str(copy) in str(e), (name, e)
            continue
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(again),
                                                        jax.tree.leaves(cache))), name


def _rewrite_manifest(copy: Path, edit) -> Path:
    """Edit the step's manifest JSON and refresh kvjax's size record, so only the schema (not
    the sizes) is wrong."""
    path = copy / "1" / "manifest" / "metadata"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    sizes = copy / "1" / checkpoint.FILES
    record = json.loads(sizes.read_text())
    record["manifest/metadata"] = path.stat().st_size
    sizes.write_text(json.dumps(record))
    return path


def _as_first_layout(serialized: bytes, name: bytes) -> bytes:
    """An exported pytree as the first layout of a store named it: `name` (`....v2`) with its
    version cut off, the flatbuffer string's length and terminator rewritten."""
    import struct
    data = bytearray(serialized)
    i = data.index(name)
    assert struct.unpack("<I", data[i - 4:i]) == (len(name),)
    data[i - 4:i] = struct.pack("<I", len(name) - 3)
    data[i + len(name) - 3] = 0
    return bytes(data)


def _kivi_cache():
    k = jax.random.normal(jax.random.key(0), (1, 2, 64, 64))
    pos = jax.numpy.broadcast_to(jax.numpy.arange(64, dtype=jax.numpy.int32), (1, 64))
    cache = (kvjax.write(kvjax.init_cache(1, 2, 64, 64), k, k, pos),)
    t = kvjax.kivi(bits=4, group=32, residual=32)
    return t.update(cache, t.init(cache), None)[0]


def _paged_kivi_keys():
    """A paged KIVI layer's key pages (a page pool is not checkpointed, its stores are)."""
    from kvjax.memory.paged_kivi import from_residual
    return from_residual(_kivi_cache(), max_pages=4, device_pages=8)[1][0].body.k


FIRST_LAYOUTS = {  # cache, its store's serialized name, what the refusal names
    "kivi": (_kivi_cache, b"kvjax.PackedChannels.v2", r"KIVI \(PackedChannels\) key store"),
    "paged_kivi": (_paged_kivi_keys, b"kvjax.ChannelPages.v2",
                   r"paged KIVI \(ChannelPages\) key store"),
}


@pytest.mark.parametrize("kind", FIRST_LAYOUTS)
def test_a_checkpoint_of_a_first_store_layout_is_refused_by_name(tmp_path, kind):
    """A cache saved before KIVI's table became lane-flat (its store serialized as
    `kvjax.PackedChannels`), or before paged KIVI's key pages did (`kvjax.ChannelPages`), is
    refused naming the store, the layout and what to do, not reported as damaged; this
    version's cache round-trips bit for bit."""
    import base64
    make, name, what = FIRST_LAYOUTS[kind]
    cache = make()
    checkpoint.save(tmp_path, cache)
    back, _ = checkpoint.restore(tmp_path)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _rewrite_manifest(tmp_path, lambda m: m.update(structure=base64.b64encode(
        _as_first_layout(base64.b64decode(m["structure"]), name)).decode()))
    with pytest.raises(ValueError, match=rf"checkpoint .*{what} in the layout kvjax used "
                                         rf"before .* save it again"):
        checkpoint.restore(tmp_path)


CHECKPOINT_EDITS = {
    "unexpected object": lambda m: m.update(namedtuples=["kvjax.tools.checkpoint.save"]),
    "untrusted module": lambda m: m.update(namedtuples=["os.system"]),
    "module that is not there": lambda m: m.update(namedtuples=["kvjax.no_such.Thing"]),
    "missing key": lambda m: m.pop("structure"),
    "extra key": lambda m: m.update(surprise=True),
    "wrong type": lambda m: m.update(meta=[1]),
    "garbage structure": lambda m: m.update(structure="bm90IGEgcHl0cmVl"),
}


@pytest.mark.parametrize("edit", CHECKPOINT_EDITS)
def test_checkpoint_manifest_with_the_wrong_schema(saved_checkpoint, tmp_path, edit):
    root, _ = saved_checkpoint
    copy = tmp_path / "c"
    shutil.copytree(root, copy)
    _rewrite_manifest(copy, CHECKPOINT_EDITS[edit])
    status, lines = cli_outcome(lambda: checkpoint.restore(copy))
    assert_one_error_naming((status, lines), copy)


# ----------------------------------------------------------------------------- plugins


PLUGIN_SOURCES = {
    "syntax error": "def broken(:\n    pass\n",
    "raises at import": "raise RuntimeError('plugin refuses to load')\n",
    "exits at import": "import sys\nsys.exit(3)\n",
    "garbage": None,  # bytes, below
    "empty": "",
    "truncate": "from kvjax.policies import methods\nmethods.register_method('half', lambda ratio",
}


@pytest.mark.parametrize("kind", PLUGIN_SOURCES)
def test_damaged_plugin_is_one_error_naming_it(tmp_path, monkeypatch, kind, capsys):
    from experiments.cli import main as cli
    from kvjax.policies import methods

    path = tmp_path / f"plugin_{kind.replace(' ', '_')}.py"
    source = PLUGIN_SOURCES[kind]
    path.write_bytes(garbage(b"import kvjax\n" * 20) if source is None else source.encode())
    monkeypatch.setenv(methods.PLUGINS_ENV, str(path))
    monkeypatch.setattr(methods, "_loaded_plugins", set())
    status = cli.main(["generate", "--prompt", "Hi", "--method", "my_plugin_method"])
    lines = capsys.readouterr().err.splitlines()
    assert_one_error_naming((status, lines), path)
    if kind != "empty":
        assert lines[-1].startswith(f"kvjax: error: plugin {path}: ")


@pytest.mark.parametrize("where", ["missing.py", "no/such/dir/plugin.py", "a_folder"])
def test_a_plugin_path_that_is_not_a_file_is_an_error(tmp_path, monkeypatch, where, capsys):
    """Even when the method is a built-in one (the plugin would never be needed)."""
    from experiments.cli import main as cli
    from kvjax.policies import methods

    (tmp_path / "a_folder").mkdir()
    path = tmp_path / where
    monkeypatch.setenv(methods.PLUGINS_ENV, str(path))
    monkeypatch.setattr(methods, "_loaded_plugins", set())
    status = cli.main(["generate", "--prompt", "Hi", "--method", "full"])
    lines = capsys.readouterr().err.splitlines()
    assert_one_error_naming((status, lines), path)
    assert lines[-1].startswith(f"kvjax: error: plugin {path}: ")


# ----------------------------------------------------------------------------- HF models


def _hf_copy(tmp_path: Path) -> Path:
    out = tmp_path / "hf"
    shutil.copytree(TINY_HF, out)
    return out


def test_a_healthy_hf_directory_loads(tmp_path):
    from models.loading import load_hf_dir

    cfg, params = load_hf_dir(_hf_copy(tmp_path))
    assert cfg.num_layers >= 1 and params


HF_CASES = ([(name, d) for name in ("config.json", "model.safetensors") for d in DAMAGES]
            + [("config.json", d) for d in ("not an object", "missing key", "bad value")])


@pytest.mark.parametrize("name, damage", HF_CASES)
def test_damaged_hf_directory_names_the_file(tmp_path, monkeypatch, name, damage, capsys):
    from experiments.cli import main as cli

    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "cache"))
    out = _hf_copy(tmp_path)
    path = out / name
    if damage in DAMAGES:
        path.write_bytes(DAMAGES[damage](path.read_bytes()))
    else:
        config = json.loads(path.read_text())
        config = {"not an object": [1, 2], "missing key": {k: v for k, v in config.items()
                                                          if k != "num_hidden_layers"},
                  "bad value": {**config, "hidden_size": -3}}[damage]
        path.write_text(json.dumps(config))
    status = cli.main(["generate", "--model", str(out), "--prompt", "Hi"])
    assert_one_error_naming((status, capsys.readouterr().err.splitlines()), path)


# ----------------------------------------------------------------------------- CPU kernel


FAKE_CXX = """#!/bin/sh
# copies the real kernel library to the -o argument: a "compiler" that takes no time
while [ $# -gt 0 ]; do
  if [ "$1" = "-o" ]; then cp "{library}" "$2"; exit 0; fi
  shift
done
exit 1
"""

KERNEL_RUN = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from kvjax.core import cpu_kernel
    assert cpu_kernel.registered(), "the kernel did not register"
    x, w = jax.random.normal(jax.random.key(0), (1, 64)), jnp.ones((64, 32))
    assert bool(jnp.allclose(cpu_kernel.matmul(x, w), x @ w, atol=1e-4))
    print("kernel ok")
""")


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory):
    """A cache dir whose kernel is built by a fake compiler that copies the real library."""
    from kvjax.core import cpu_kernel

    library = cpu_kernel.build()  # the real build (cached once per machine)
    root = tmp_path_factory.mktemp("kernel")
    cxx = root / "fake-cxx"
    cxx.write_text(FAKE_CXX.format(library=library))
    cxx.chmod(0o755)
    env = dict(os.environ, XDG_CACHE_HOME=str(root / "cache"), CXX=str(cxx), JAX_PLATFORMS="cpu",
               KVJAX_CPU_KERNEL="1")
    env.pop("XLA_FLAGS", None)  # one device: the kernel serves
    first = _run_kernel(env)  # builds (copies) the library and its record
    assert first.returncode == 0 and "kernel ok" in first.stdout, first.stderr[-2000:]
    assert "kvjax: rebuilding" not in first.stderr
    return env


def _run_kernel(env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", KERNEL_RUN], env=env, capture_output=True,
                          text=True, timeout=300, cwd=REPO)


def _built(env) -> Path:
    (so,) = Path(env["XDG_CACHE_HOME"], "kvjax", "cpu_kernels").glob("decode_attention-*.so")
    return so


@pytest.mark.parametrize("damage", [*DAMAGES, "record missing", "record garbage",
                                    "record of another file"])
def test_a_damaged_cached_kernel_is_rebuilt_with_one_notice(kernel_cache, damage):
    so = _built(kernel_cache)
    record = so.with_name(so.name + ".json")
    good = so.read_bytes()
    if damage in DAMAGES:
        so.write_bytes(DAMAGES[damage](good))
    elif damage == "record missing":
        record.unlink()
    elif damage == "record garbage":
        record.write_bytes(garbage(record.read_bytes()))
    else:
        record.write_text(json.dumps({"size": len(good), "sha256": "0" * 64}))
    again = _run_kernel(kernel_cache)
    assert again.returncode == 0, (again.returncode, again.stderr[-2000:])  # no SIGBUS (-7)
    assert "kernel ok" in again.stdout
    notices = [l for l in again.stderr.splitlines() if l.startswith("kvjax: rebuilding")]
    assert len(notices) == 1 and str(so) in notices[0], again.stderr[-2000:]
    assert "Traceback" not in again.stderr
    assert so.read_bytes() == good  # rebuilt
    if damage == "truncate":
        third = _run_kernel(kernel_cache)  # and trusted again: no notice
        assert third.returncode == 0 and "kvjax: rebuilding" not in third.stderr


# ----------------------------------------------------------------------------- GGUF files


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tests.test_loading import write_gguf
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "llama_tied")


@pytest.mark.parametrize("damage", [*DAMAGES, "magic then garbage"])
def test_damaged_gguf_names_the_file(tiny_gguf, tmp_path, monkeypatch, damage, capsys):
    from experiments.cli import main as cli

    monkeypatch.setenv("KVJAX_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    data = tiny_gguf.read_bytes()
    path.write_bytes(b"GGUF" + garbage(data[4:]) if damage == "magic then garbage"
                     else DAMAGES[damage](data))
    status = cli.main(["generate", "--model", str(path), "--prompt", "Hi"])
    assert_one_error_naming((status, capsys.readouterr().err.splitlines()), path)
