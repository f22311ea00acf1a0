"""Checkpoints that survive a kill: atomic saves, validated loads, the latest complete one, clean resumes.

A save writes everything into a temporary folder beside the final one (``checkpoints/.tmp-step_N``):
``model/`` (a plain transformers model folder with its tokenizer), ``trainer_state.pt`` (optimizer,
value head, step, RNG states, config) and, last, ``checkpoint.json`` (every file with its size).
Each file and folder is fsynced, the folder is renamed to ``step_N`` and the ``latest`` pointer is
replaced atomically. A kill at any point leaves either the previous checkpoint or the new one.

A resume (:func:`resolve_checkpoint`) takes a checkpoint folder, or a run / ``checkpoints`` folder
(then the newest *complete* checkpoint, reached by ``latest`` or by scanning), checks the manifest
(a clear error names what is missing or cut short), trims ``metrics.jsonl`` back to the checkpoint's
step so no step is logged twice, and lists settings that differ from the checkpoint's (refused unless
``allow_config_change``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import torch

STATE_FILE = "trainer_state.pt"
MANIFEST = "checkpoint.json"
LATEST = "latest"
FORMAT = 1
# settings that may differ on resume: how long, where, how verbosely and in how many processes the run goes on
RESUMABLE_SETTINGS = frozenset({"steps", "resume", "output_dir", "progress", "threads", "save_every", "eval_every",
                                "eval_episodes", "allow_config_change", "nproc", "parallel"})


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (missing or cut-short files), or no complete one."""


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def trainer_state(trainer) -> dict:
    """Everything a resume needs besides the weights (FSDP shards gathered: every rank must call it)."""
    from trainer.distributed import full_optimizer_state, full_state_dict

    return {
        "step": trainer.step,
        "optimizer": full_optimizer_state(trainer.optimizer),
        "value_head": full_state_dict(trainer.value_head) if trainer.value_head else None,
        "initial_model": trainer.initial_model,
        "config": dataclasses.asdict(trainer.config),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
    }


def save_checkpoint(trainer, path: Path) -> Path:
    """Write the trainer's checkpoint to ``path`` atomically (see the module docstring); returns ``path``.

    With several ranks every rank calls it (FSDP's shards are gathered, a collective) and rank 0 writes."""
    from trainer.lora import merged_state_dict, save_merged

    state, weights = trainer_state(trainer), merged_state_dict(trainer.policy)
    if not trainer.dp.is_main:
        return path
    path = Path(path)
    root = path.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{path.name}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
    save_merged(trainer.policy, tmp / "model", weights)  # LoRA: merged weights, the adapter alone in adapter/
    trainer.tokenizer.save_pretrained(tmp / "model")
    torch.save(state, tmp / STATE_FILE)
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {"format": FORMAT, "step": trainer.step,
                "files": {str(p.relative_to(tmp)): p.stat().st_size for p in files}}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for p in [*files, tmp / MANIFEST, tmp / "model", tmp]:
        _fsync(p)
    if path.exists():  # the same step saved again: swap the old one out, never leave neither
        old = root / f".old-{path.name}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(path.name + "\n")
    _fsync(pointer)
    os.replace(pointer, root / LATEST)
    _fsync(root)
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
            if skipped:
                warnings.warn(f"resume: skipped incomplete checkpoints {skipped}; using {candidate}", stacklevel=2)
            return candidate
        skipped.append(candidate.name)
    raise CheckpointError(f"resume: no complete checkpoint under {root}"
                          + (f" (incomplete: {', '.join(skipped)})" if skipped else ""))


def load_state(path: Path) -> dict:
    """``trainer_state.pt`` of a validated checkpoint; a clear error if it cannot be read."""
    try:
        state = torch.load(Path(path) / STATE_FILE, weights_only=False, map_location="cpu")
    except Exception as error:  # noqa: BLE001 (torch raises many kinds for a damaged file)
        raise CheckpointError(f"resume: cannot read {Path(path) / STATE_FILE}: {type(error).__name__}: {error}") from None
    missing = {"step", "optimizer", "initial_model", "config", "rng"} - set(state)
    if missing:
        raise CheckpointError(f"resume: {Path(path) / STATE_FILE} lacks {sorted(missing)}")
    return state


def changed_settings(saved: dict, config) -> list[str]:
    """``"name: saved -> now"`` for every setting that differs from the checkpoint's (resumable ones aside;
    the learning rate compared as used: an unset one is the scaled default, ``TrainConfig.learning_rate``)."""
    now = dataclasses.asdict(config)
    if "lr" in saved and saved["lr"] is None:
        known = {f.name for f in dataclasses.fields(config)}
        saved = {**saved, "lr": dataclasses.replace(config, **{k: v for k, v in saved.items() if k in known}).learning_rate}
    now["lr"] = config.learning_rate
    return [f"{name}: {saved[name]!r} -> {now[name]!r}" for name in sorted(now)
            if name in saved and name not in RESUMABLE_SETTINGS and saved[name] != now[name]]


def check_settings(saved: dict, config) -> None:
    """Refuse a resume with changed settings unless ``config.allow_config_change``; warn when allowed."""
    changes = changed_settings(saved, config)
    if not changes:
        return
    listing = "; ".join(changes)
    if not getattr(config, "allow_config_change", False):
        raise CheckpointError(f"resume: settings differ from the checkpoint's: {listing} "
                              "(pass --allow-config-change to resume with them anyway)")
    warnings.warn(f"resume with changed settings: {listing}", stacklevel=2)


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
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        _fsync(tmp)
        os.replace(tmp, path)
    return dropped
