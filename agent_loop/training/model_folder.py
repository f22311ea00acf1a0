"""A fine-tuned model's folders, written as a checkpoint is (``agent_loop.training.checkpoint``): atomically, with
a manifest. The model folder (:func:`save_model`: one that ``--model`` loads) and the latest checkpoint of a run
(:func:`save_latest_checkpoint`: the earlier ones removed, each holds a whole model)."""

from __future__ import annotations

from pathlib import Path

import agent_loop.training.checkpoint as checkpoint


def model_filler(model, tokenizer):
    """What fills a model folder: ``model`` and ``tokenizer`` (its chat template too), saved into the folder given."""
    def fill(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return fill


def save_model(model, tokenizer, folder: Path, *, step: int) -> Path:
    """``model`` and ``tokenizer`` as model folder ``folder``, written as a checkpoint is
    (``agent_loop.training.checkpoint.write_folder``): beside it first, with a manifest (sizes, sha256, ``step``),
    fsynced, renamed into place; an earlier folder there is swapped out, never emptied first."""
    return checkpoint.write_folder(folder, fill=model_filler(model, tokenizer),
                                   manifest={"format": checkpoint.FORMAT, "step": step})


def save_latest_checkpoint(root: Path, step: int, state: dict, model, tokenizer) -> Path:
    """The checkpoint of step ``step`` at ``root/step_NNNNNN`` (``agent_loop.training.checkpoint.write_checkpoint``:
    the model, its tokenizer and ``state``); the earlier ones under ``root`` are removed once it is complete."""
    return checkpoint.write_checkpoint(root / f"step_{step:06d}", step=step, save_model=model_filler(model, tokenizer),
                                       state=state, keep=1)
