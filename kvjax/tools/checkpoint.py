"""Checkpoints of kvjax pytrees (caches, transform states, weights) with orbax.

A checkpoint directory holds numbered steps, each written by orbax's
`CheckpointManager`: arrays under `arrays/`, and a JSON `manifest/` with the
pytree's structure, the caller's metadata and the versions that wrote it. A
step becomes visible only when orbax has finished writing it (it writes a
temporary folder and renames it), so a save that is killed midway leaves the
previous step readable; `restore` reads the newest finished step.

The structure is the pytree's `PyTreeDef` as `jax.export` serializes it, so
every type that `jax.export` can carry (the cache layers, stores, and named
tuples of `kvjax` and `models`, registered here on demand) round-trips without
pickle and without a target built by hand.

Example:
    >>> import tempfile, kvjax
    >>> cache = kvjax.init_model_cache(kvjax.CacheSpec(2, 1, 4), batch=1, capacity=8)
    >>> path = save(tempfile.mkdtemp(), cache, meta={"method": "full"})
    >>> again, meta = restore(path.parent, expect={"method": "full"})
    >>> meta["method"], again[0].k.shape
    ('full', (1, 8, 4))
"""

from __future__ import annotations

import base64
import importlib
import json
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from kvjax.core.stores import StoreFormatError

FORMAT = 1
"""Version of the manifest layout; a newer one is refused with a clear error."""

_TRUSTED_MODULES = ("kvjax.", "models.")
"""Named tuples from these packages are registered for (de)serialization on demand."""


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _node_types(treedef: jax.tree_util.PyTreeDef) -> set[type]:
    """Every node type of a pytree structure (leaves excluded)."""
    data = treedef.node_data()
    types = {data[0]} if data is not None else set()
    for child in treedef.children():
        types |= _node_types(child)
    return types


def _namedtuple_types(tree: Any) -> list[type]:
    nodes = _node_types(jax.tree_util.tree_structure(tree))
    return sorted((t for t in nodes if issubclass(t, tuple) and hasattr(t, "_fields")),
                  key=_type_name)


def _register_namedtuple(cls: type) -> None:
    try:
        jax.export.register_namedtuple_serialization(cls, serialized_name=_type_name(cls))
    except ValueError:  # registered already (by an earlier save or restore)
        pass


def _import_type(name: str) -> type:
    """The named-tuple class `name` names: only from kvjax or models, only a named tuple."""
    if not isinstance(name, str) or not name.startswith(_TRUSTED_MODULES):
        raise ValueError(f"checkpoint names type {name!r}; only types from "
                         f"{', '.join(m.rstrip('.') for m in _TRUSTED_MODULES)} are loaded")
    # the longest importable module prefix, then attributes: never a module outside the two
    parts = name.split(".")
    cls = None
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        try:
            cls = importlib.import_module(module)
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                cls = getattr(cls, part)
        except AttributeError:
            cls = None
        break
    if not (isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")):
        raise ValueError(f"checkpoint names type {name!r}, which is not a named tuple of "
                         f"kvjax or models")
    return cls


def _serialize_structure(tree: Any) -> tuple[str, list[str]]:
    """(base64 of the serialized PyTreeDef and leaf avals, named-tuple type names)."""
    named = _namedtuple_types(tree)
    for cls in named:
        _register_namedtuple(cls)
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)
    exported = jax.export.export(jax.jit(lambda t: t), platforms=["cpu"])(abstract)
    return base64.b64encode(exported.serialize()).decode(), [_type_name(c) for c in named]


def _abstract_tree(structure: str, named: list[str]) -> Any:
    """The pytree of `jax.ShapeDtypeStruct` that `_serialize_structure` described."""
    for name in named:
        _register_namedtuple(_import_type(name))
    exported = jax.export.deserialize(base64.b64decode(structure))
    return jax.tree_util.tree_unflatten(exported.in_tree, exported.in_avals)[0][0]


def _manager(directory: Path, *, read_only: bool = False) -> ocp.CheckpointManager:
    keep = dict(create=False) if read_only else dict(max_to_keep=2)
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, **keep)
    return ocp.CheckpointManager(directory, options=options, item_names=("arrays", "manifest"))


def save(directory: str | Path, tree: Any, *, meta: Mapping[str, Any] | None = None) -> Path:
    """Write `tree` (arrays, kvjax caches and states) as the next step of `directory`.

    `meta` (JSON-serializable) is stored beside it and checked by `restore`'s
    `expect`. Returns the step's path. The previous step stays readable until
    this one is complete; the two newest steps are kept.
    """
    directory = Path(directory).absolute()
    structure, named = _serialize_structure(tree)
    leaves = {f"{i:05d}": leaf for i, leaf in enumerate(jax.tree_util.tree_leaves(tree))
              if np.size(leaf)}  # orbax refuses empty arrays; `restore` rebuilds them
    manifest = dict(format=FORMAT, structure=structure, namedtuples=named,
                    meta=dict(meta or {}), versions=dict(jax=jax.__version__,
                                                         orbax=ocp.__version__))
    with _manager(directory) as manager:
        step = (manager.latest_step() or 0) + 1
        manager.save(step, args=ocp.args.Composite(arrays=ocp.args.StandardSave(leaves),
                                                   manifest=ocp.args.JsonSave(manifest)))
        manager.wait_until_finished()
    step_dir = directory / str(step)
    record = step_dir / f".{FILES}.tmp"
    record.write_text(json.dumps(_file_sizes(step_dir)), encoding="utf-8")
    record.replace(step_dir / FILES)
    return step_dir


FILES = "kvjax-files.json"
"""Sizes of every file of a step, written by `save` once orbax has finished the step."""

_MANIFEST_KEYS = {"format": int, "structure": str, "namedtuples": list, "meta": dict,
                  "versions": dict}


def _damaged(where: Path, e: Exception) -> ValueError:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return ValueError(f"checkpoint {where}: damaged or unreadable ({type(e).__name__}: {first})")


def _file_sizes(step: Path) -> dict[str, int]:
    return {str(f.relative_to(step)): f.stat().st_size for f in sorted(step.rglob("*"))
            if f.is_file() and f.name != FILES}


def _check_files(step: Path) -> None:
    """ValueError naming a file of `step` that is missing or not the size `save` recorded
    (a step written before the record existed is read unchecked)."""
    record = step / FILES
    if not record.is_file():
        return
    try:
        want = json.loads(record.read_text("utf-8"))
        if not isinstance(want, dict) or not all(isinstance(v, int) for v in want.values()):
            raise ValueError("not a {file: size} record")
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint {record}: unreadable ({e})") from None
    have = _file_sizes(step)
    for name, size in want.items():
        if name not in have:
            raise ValueError(f"checkpoint {step / name}: missing (the step recorded it)")
        if have[name] != size:
            raise ValueError(f"checkpoint {step / name}: {have[name]} bytes, {size} when saved "
                             f"(truncated or altered)")


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of the newest finished step (structure, meta, versions), schema-checked."""
    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist")
    try:
        with _manager(directory, read_only=True) as manager:
            step = manager.latest_step()
            if step is None:
                raise FileNotFoundError(f"{directory} holds no finished checkpoint")
            _check_files(directory / str(step))
            manifest = manager.restore(step, args=ocp.args.Composite(
                manifest=ocp.args.JsonRestore()))["manifest"]
    except (FileNotFoundError, ValueError) as e:
        if str(directory) in str(e):
            raise
        raise _damaged(directory, e) from None
    except Exception as e:  # orbax / tensorstore errors on damaged files
        raise _damaged(directory, e) from None
    where = directory / str(step) / "manifest"
    if not isinstance(manifest, dict):
        raise ValueError(f"checkpoint {where}: the manifest is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{directory}: checkpoint format {manifest.get('format')!r}, this kvjax "
                         f"reads format {FORMAT}")
    missing = sorted(set(_MANIFEST_KEYS) - set(manifest))
    extra = sorted(set(manifest) - set(_MANIFEST_KEYS))
    wrong = sorted(k for k, t in _MANIFEST_KEYS.items()
                   if k in manifest and not isinstance(manifest[k], t))
    if missing or extra or wrong:
        raise ValueError(f"checkpoint {where}: manifest keys missing {missing}, unexpected "
                         f"{extra}, of the wrong type {wrong}")
    return dict(manifest, step=step)


def check_meta(saved: Mapping[str, Any], expect: Mapping[str, Any], where: Any) -> None:
    """Raise a `ValueError` naming every key whose saved value differs from `expect`."""
    wrong = [f"{key}: saved {saved.get(key)!r}, expected {value!r}"
             for key, value in expect.items() if saved.get(key) != value]
    if wrong:
        raise ValueError(f"checkpoint {where} does not match: " + "; ".join(wrong))


def restore(directory: str | Path, *, expect: Mapping[str, Any] | None = None,
            sharding: jax.sharding.Sharding | Callable[[jax.ShapeDtypeStruct], Any] | None = None,
            ) -> tuple[Any, dict[str, Any]]:
    """(tree, meta) of the newest finished step of `directory`.

    `expect`: metadata that must match the saved `meta` (e.g. the model and the
    method), checked before any array is read. `sharding`: one sharding for
    every array, or a function of each array's abstract value that returns
    its sharding (arrays are then read directly into place, e.g. onto a
    mesh); default: the first device.
    """
    directory = Path(directory).absolute()
    manifest = read_manifest(directory)
    check_meta(manifest["meta"], expect or {}, directory / str(manifest["step"]))
    where = directory / str(manifest["step"])
    try:
        abstract = _abstract_tree(manifest["structure"], manifest["namedtuples"])
    except ValueError as e:
        if "checkpoint names type" in str(e) or isinstance(e, StoreFormatError):
            raise ValueError(f"checkpoint {where}: {e}") from None
        raise _damaged(where, e) from None
    except Exception as e:  # a structure that is not a serialized pytree
        raise _damaged(where, e) from None
    leaves, treedef = jax.tree_util.tree_flatten(abstract)
    place = sharding if callable(sharding) else (
        lambda aval: sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    targets = {f"{i:05d}": jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=place(a))
               for i, a in enumerate(leaves)}
    stored = {k: t for k, t in targets.items() if np.prod(t.shape)}
    try:
        with _manager(directory, read_only=True) as manager:
            arrays = manager.restore(manifest["step"], args=ocp.args.Composite(
                arrays=ocp.args.StandardRestore(stored)))["arrays"] if stored else {}
    except Exception as e:  # orbax / tensorstore errors on damaged array files
        raise _damaged(where, e) from None
    bad = [k for k, t in stored.items() if k not in arrays or arrays[k].shape != t.shape
           or arrays[k].dtype != t.dtype]
    if bad:
        raise ValueError(f"checkpoint {where}: arrays {bad[:5]} do not match the manifest's "
                         f"structure")
    empty = lambda t: jax.device_put(np.zeros(t.shape, t.dtype), t.sharding)
    tree = jax.tree_util.tree_unflatten(treedef, [arrays[k] if k in arrays else empty(t)
                                                  for k, t in targets.items()])
    return tree, manifest["meta"]
