"""The RL recipe reads top to bottom (issue 55): following a run of ``train`` through the code enters the recipe's
file from outside only a few times; every other call it makes goes down into the library and returns, with no
call back up into the recipe."""

from __future__ import annotations

import sys
from pathlib import Path

import agent_loop.recipes.train as recipe
from agent_loop import Trainer
from tests.helpers.trainer_config import small_config

RECIPE = str(Path(recipe.__file__).resolve())


def entries_into_the_recipe(run) -> list[str]:
    """The calls into a function of the recipe's file whose caller is in another file, while ``run()`` runs (a
    plain serial trace: ``sys.setprofile`` sees every Python call of this thread)."""
    entries = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename == RECIPE and frame.f_back is not None \
                and frame.f_back.f_code.co_filename != RECIPE:
            entries.append(f"{frame.f_code.co_name} <- {Path(frame.f_back.f_code.co_filename).name}")

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return entries


def test_a_training_run_enters_the_recipe_at_most_8_times(tiny_mid, tmp_path):
    """Two steps with an evaluation and checkpoints: the caller builds the Trainer and runs ``train()``; the
    library never calls back into the recipe. (The same trace of the trainer of 84630b4 counted 14: asyncio's
    loop entering its ``_play`` 10 times, the checkpoint writer calling back its ``save_model`` twice.)"""
    config = small_config(tiny_mid, tmp_path, steps=2, eval_every=1, eval_episodes=4, save_every=1)
    entries = entries_into_the_recipe(lambda: Trainer(config).train())
    assert 2 <= len(entries) <= 8, entries
    assert {entry.split(" <- ")[1] for entry in entries} == {Path(__file__).name}, entries  # only from the caller
