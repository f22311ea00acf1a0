"""Checkpoints that survive a kill: atomic saves, validated loads, the latest complete one, clean resumes.

A save writes everything into a temporary folder beside the final one (``checkpoints/.tmp-step_N``):
``model/`` (a plain transformers model folder with its tokenizer), ``trainer_state.pt`` (optimizer,
value head, step, RNG states, config; asynchronously also where the question stream stands) and, last,
``checkpoint.json`` (every file with its size).
Each file and folder is fsynced, the folder is renamed to ``step_N`` and the ``latest`` pointer is
replaced atomically. A kill at any point leaves either the previous checkpoint or the new one.

Nothing in a checkpoint runs code: ``trainer_state.pt`` holds plain tensors, dicts, lists, numbers and
strings (RNG states included) and is read with ``torch.load(weights_only=True)``; an older one, whose
numpy RNG state was pickled as an array, is read with numpy's array reconstruction allowed and nothing
else. The manifest holds each file's size and sha256: a file damaged at the same size is refused by
name, and a resume refuses weights or optimizer moments that are not finite (:func:`check_finite`).

A resume (:func:`resolve_checkpoint`) takes a checkpoint folder, or a run / ``checkpoints`` folder
(then the newest *complete* checkpoint, reached by ``latest`` or by scanning), checks the manifest
(a clear error names what is missing or cut short), trims ``metrics.jsonl`` back to the checkpoint's
step so no step is logged twice, and lists settings that differ from the checkpoint's (refused unless
``allow_config_change``).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import pickle
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

import agent_loop.files as files
from agent_loop.runners.outputs import changed_settings as differing  # the one comparison (rollout --resume too)
from agent_loop.runners.outputs import refuse_changed

STATE_FILE = "trainer_state.pt"
MANIFEST = "checkpoint.json"
LATEST = "latest"
FORMAT = 2  # 2: sha256 per file, plain (weights_only-loadable) trainer state; 1: sizes only
# what an older trainer_state.pt needs besides plain types: its numpy RNG state (an array), nothing that runs code
_OLD_STATE_GLOBALS = frozenset({"numpy.dtype", "numpy.ndarray", "numpy._core.multiarray._reconstruct",
                                "numpy.core.multiarray._reconstruct"})
_HASH_CHUNK = 1 << 22
# settings that may differ on resume: how long, where, how verbosely and in how many processes the run goes on
RESUMABLE_SETTINGS = frozenset({"steps", "resume", "output_dir", "progress", "verbose", "threads", "save_every", "keep_checkpoints", "eval_every",
                                "eval_episodes", "check_episodes", "save_rollouts_every", "allow_config_change", "nproc", "parallel", "overwrite",
                                # where the episodes are played, not what they are (ServerOptions): servers move
                                "server", "served_model_name", "retry_deadline_s", "request_timeout_s"})


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (missing or cut-short files), or no complete one."""


def rng_state() -> dict:
    """The torch, Python and numpy RNG states as plain values (a tensor, tuples of ints, a dict)."""
    numpy = np.random.get_state(legacy=False)  # {"bit_generator", "state": {"key": uint32 array, "pos"}, ...}
    numpy["state"] = {**numpy["state"], "key": torch.from_numpy(numpy["state"]["key"].astype(np.int64))}
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy}


def set_rng_state(rng: dict) -> None:
    """Restore :func:`rng_state`'s states (or those of a format-1 checkpoint: numpy's legacy tuple)."""
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    numpy = rng["numpy"]
    if isinstance(numpy, dict):
        numpy = {**numpy, "state": {**numpy["state"], "key": numpy["state"]["key"].numpy().astype(np.uint32)}}
    np.random.set_state(numpy)


_digests: dict[tuple, str] = {}  # (path, size, mtime_ns) -> sha256: the preflight and the trainer hash once


def sha256(path: Path) -> str:
    """The file's sha256 (hex), read in chunks."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _digests:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
        _digests[key] = digest.hexdigest()
    return _digests[key]


def write_folder(path: Path, *, fill, manifest: dict | None = None) -> Path:
    """Write folder ``path`` atomically (:func:`agent_loop.files.write_folder`): ``fill(tmp)`` writes into
    ``.tmp-NAME`` beside it, then :data:`MANIFEST` (every file's size and sha256, and ``manifest``'s keys), every
    file and folder fsynced, the folder renamed into place (an existing ``path`` swapped out via ``.old-NAME``,
    never removed first). :func:`problems` and :func:`damaged` check such a folder. Returns ``path``."""
    def filled(tmp: Path) -> None:
        fill(tmp)
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        (tmp / MANIFEST).write_text(json.dumps({**(manifest or {}),
                                                "files": {str(p.relative_to(tmp)): p.stat().st_size for p in files},
                                                "sha256": {str(p.relative_to(tmp)): sha256(p) for p in files}},
                                               indent=1))

    path = Path(path)
    files.write_folder(path, filled)
    return path


def write_checkpoint(path: Path, *, step: int, state: dict, save_model, keep: int = 0) -> Path:
    """Write a checkpoint folder atomically (:func:`write_folder`): ``save_model(folder)`` fills ``model/``,
    ``state`` (plain values and tensors) goes to ``trainer_state.pt``, then the manifest, and ``latest`` is
    pointed at it; then, with ``keep`` > 0, the step folders beside it but the ``keep`` newest are removed (never
    before the new one is complete). ``train`` and ``warmstart`` both save this way."""
    def fill(tmp: Path) -> None:
        save_model(tmp / "model")
        torch.save(state, tmp / STATE_FILE)

    path = write_folder(path, fill=fill, manifest={"format": FORMAT, "step": step})
    files.write_text(path.parent / LATEST, path.name + "\n")
    if keep:
        for older in [p for p in _step_folders(path.parent) if p != path][keep - 1:]:
            shutil.rmtree(older, ignore_errors=True)
    return path


def problems(path: Path) -> list[str]:
    """What is wrong with checkpoint folder ``path`` (empty: complete)."""
    path = Path(path)
    if not path.is_dir():
        return [f"{path} is not a folder"]
    manifest_path = path / MANIFEST
    if not manifest_path.exists():  # a checkpoint from before manifests: check the essentials
        needed = [path / STATE_FILE, path / "model" / "config.json"]
        found = [p for p in needed if p.exists() and p.stat().st_size > 0]
        weights = list((path / "model").glob("*.safetensors")) + list((path / "model").glob("*.bin"))
        return ([f"missing or empty {p.relative_to(path)}" for p in needed if p not in found]
                + ([] if weights else ["no model weights in model/"]))
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError) as error:
        return [f"unreadable {MANIFEST}: {error}"]
    found = []
    for name, size in files.items():
        file = path / name
        if not file.exists():
            found.append(f"missing {name}")
        elif file.stat().st_size != size:
            found.append(f"{name} has {file.stat().st_size} bytes, not {size}")
    return found


def damaged(path: Path) -> list[str]:
    """The files of complete checkpoint ``path`` whose sha256 differs from the manifest's (format 1: none known)."""
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.exists():
        return []
    digests = json.loads(manifest_path.read_text()).get("sha256", {})
    return [name for name, digest in digests.items() if sha256(Path(path) / name) != digest]


def _refuse_damaged(path: Path) -> None:
    if bad := damaged(path):
        raise CheckpointError(f"resume: checkpoint {path} is damaged: {', '.join(bad)} differ from the sha256 in its "
                              f"{MANIFEST} (same size, other bytes); resume from an earlier checkpoint folder")


def step_folder(output_dir: str | Path, step: int) -> Path:
    """The checkpoint folder of step ``step`` in a run's folder: ``OUTPUT_DIR/checkpoints/step_NNNNNN``."""
    return Path(output_dir) / "checkpoints" / f"step_{step:06d}"


def _step_folders(root: Path) -> list[Path]:
    return sorted((p for p in root.glob("step_*") if p.is_dir()), key=lambda p: p.name, reverse=True)


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder to resume from: ``path`` itself if it is one (validated), else the newest complete
    checkpoint under it (``path/checkpoints`` or ``path``), following ``latest`` first. Raises CheckpointError."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"resume: {path} does not exist")
    if (path / MANIFEST).exists() or (path / STATE_FILE).exists() or (path / "model").exists():
        found = problems(path)
        if found:
            raise CheckpointError(f"resume: checkpoint {path} is incomplete (a save was interrupted?): "
                                  + "; ".join(found) + ". Pass its run folder to resume from the latest complete one.")
        _refuse_damaged(path)
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    candidates = _step_folders(root)
    pointer = root / LATEST
    if pointer.exists():
        named = root / pointer.read_text().strip()
        candidates = [named] + [c for c in candidates if c != named]
    skipped = []
    for candidate in candidates:
        found = problems(candidate)
        if not found:
            _refuse_damaged(candidate)  # damage is not what a kill leaves: no silent fall-back past it
            if skipped:
                warnings.warn(f"resume: skipped incomplete checkpoints {skipped}; using {candidate}", stacklevel=2)
            return candidate
        skipped.append(candidate.name)
    raise CheckpointError(f"resume: no complete checkpoint under {root}"
                          + (f" (incomplete: {', '.join(skipped)})" if skipped else ""))


def _unpickle(file: Path) -> dict:
    """``torch.load(weights_only=True)``; an older state file whose only other globals are numpy's array
    reconstruction (its RNG state) is read with those allowed, any other is refused by name."""
    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError:
        needed = set(torch.serialization.get_unsafe_globals_in_checkpoint(file))
        unsafe = sorted(name for name in needed if name not in _OLD_STATE_GLOBALS
                        and not name.startswith("numpy.dtypes."))  # numpy >= 1.25 pickles dtypes by class
        if unsafe:
            raise CheckpointError(f"resume: {file} would run code to load ({', '.join(unsafe)}); refused (a "
                                  "trainer_state.pt holds plain tensors and values only)") from None
        allowed = [_global(name) for name in sorted(needed)]
        # the array's dtype class (numpy.dtypes.UInt32DType) only shows up while unpickling: numpy's dtype classes
        allowed += [getattr(np.dtypes, name) for name in dir(np.dtypes) if name.endswith("DType")]
        with torch.serialization.safe_globals(allowed):
            return torch.load(file, weights_only=True, map_location="cpu")


def _global(name: str):
    module, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


def load_state(path: Path) -> dict:
    """``trainer_state.pt`` of a validated checkpoint, read without running code; a clear error if it cannot be read."""
    file = Path(path) / STATE_FILE
    try:
        state = _unpickle(file)
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 (torch raises many kinds for a damaged file)
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise CheckpointError(f"resume: cannot read {file}: {type(error).__name__}: {message}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"resume: {file} holds a {type(state).__name__}, not a trainer state")
    missing = {"step", "optimizer", "initial_model", "config", "rng"} - set(state)
    if missing:
        raise CheckpointError(f"resume: {file} lacks {sorted(missing)}")
    check_position(state.get("producer"), file)
    return state


def check_position(position, file: Path) -> None:
    """Refuse a trainer state whose producer position (``RolloutProducer.position``) is not None or
    ``{"next_group": int >= 0, "pending": [int >= 0, ...]}`` with every pending group below ``next_group``."""
    if position is None:
        return
    def whole(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    fine = (isinstance(position, dict) and whole(position.get("next_group"))
            and isinstance(position.get("pending"), list)
            and all(whole(g) and g < position["next_group"] for g in position["pending"]))
    if not fine:
        raise CheckpointError(f"resume: {file} holds an invalid producer position {position!r} (expected "
                              "{'next_group': n, 'pending': [groups below n]})")


def check_finite(named_tensors, where: str) -> None:
    """Refuse (CheckpointError, one line) the first of ``named_tensors`` (``(name, tensor)`` pairs) that holds
    NaN or infinity: a resume would train on it and fail steps later. One host sync per tensor (load time only)."""
    for name, tensor in named_tensors:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise CheckpointError(f"resume: {where} holds non-finite values: {name} has {bad} NaN or infinite "
                                  f"entries of {tensor.numel()}; resume from an earlier checkpoint")


def optimizer_tensors(state: dict):
    """``(name, tensor)`` of an optimizer state dict's per-parameter state (AdamW's moments)."""
    for index, entry in state.get("state", {}).items():
        for name, value in entry.items():
            yield f"optimizer state {index}.{name}", value


def changed_settings(saved: dict, now: dict) -> list[str]:
    """``"name: saved -> now"`` for every setting of the run's resolved settings ``now`` (``resolved()``: the
    learning rate as used) that differs from the checkpoint's resolved ones ``saved``, resumable ones aside."""
    return differing(saved, now, set(now) - RESUMABLE_SETTINGS)


def check_settings(saved: dict, now: dict, *, allow_config_change: bool) -> None:
    """Refuse a resume with changed settings (:func:`changed_settings`) unless ``allow_config_change``; warn
    when allowed."""
    refuse_changed(changed_settings(saved, now), allowed=allow_config_change,
                   warning="resume with changed settings", refusal=lambda listing: CheckpointError(
                       f"resume: settings differ from the checkpoint's: {listing} "
                       "(pass --allow-config-change to resume with them anyway)"))


def trim_metrics(path: Path, step: int) -> int:
    """Drop records of steps after ``step`` from ``metrics.jsonl`` (and a torn last line), atomically;
    returns how many were dropped. The steps after a checkpoint are logged again by the resumed run."""
    path = Path(path)
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            dropped += 1
            continue
        if record.get("step", 0) > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        files.write_text(path, "".join(line + "\n" for line in kept))
    return dropped
