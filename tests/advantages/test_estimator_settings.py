"""The estimators' settings (advantages/settings.py): one frozen dataclass per kind of estimator, registered
with it, given to its registry entry as an instance with the same values as the plain keywords; importable
without torch (issue 55 item 2)."""

import dataclasses
import subprocess
import sys

import pytest
import torch

import advantages
from advantages import (
    ESTIMATORS,
    SETTINGS_CLASSES,
    TURN_LEVEL,
    DiscountSettings,
    GAESettings,
    GiGPOSettings,
    get_estimator,
)
from tests.helpers.turn_credit_reference import build_batch, random_episodes

SETTINGS = {DiscountSettings: DiscountSettings(gamma=0.8), GAESettings: GAESettings(gamma=0.8, lam=0.7),
            GiGPOSettings: GiGPOSettings(gamma=0.8, step_advantage_w=0.5, gigpo_mode="mean_std_norm")}


def batch_fields(entry, batch) -> dict:
    return {k: batch[k] for k in entry.batch_arguments if k in batch and k not in ("token_level_rewards", "response_mask")}


def test_each_estimator_registers_its_settings_and_they_are_keywords_of_its_function():
    assert {n: e.settings for n, e in ESTIMATORS.items() if e.settings is not None} == {
        "reinforce_plus_plus": DiscountSettings, "reinforce_plus_plus_reset_at_observation": DiscountSettings,
        "reinforce_plus_plus_ignore_mask": DiscountSettings, "turn_returns": DiscountSettings,
        "turn_rloo": DiscountSettings, "turn_index_normalized": DiscountSettings, "gae": GAESettings,
        "turn_gae": GAESettings, "gigpo": GiGPOSettings}
    for entry in ESTIMATORS.values():
        if entry.settings is not None:
            assert entry.settings in SETTINGS_CLASSES  # the application declares its options from these
            assert {f.name for f in dataclasses.fields(entry.settings)} <= set(entry.hyperparameters), entry.name


def test_turn_level_lists_the_turn_credit_estimators():
    assert set(TURN_LEVEL) == {n for n, e in ESTIMATORS.items() if e.fn.__module__ == "advantages.turn_credit"}


@pytest.mark.parametrize("name", sorted(n for n, e in ESTIMATORS.items() if e.settings is not None))
def test_settings_give_what_the_same_keywords_give(name):
    entry = get_estimator(name)
    batch = build_batch(random_episodes(torch.Generator().manual_seed(3), 3, 3))
    fields = batch_fields(entry, batch)
    settings = SETTINGS[entry.settings]
    rewards, mask = batch["token_level_rewards"], batch["response_mask"]
    given = entry(rewards, mask, settings=settings, **fields)
    plain = entry.fn(token_level_rewards=rewards, response_mask=mask, **dataclasses.asdict(settings), **fields)
    assert all(torch.equal(a, b) for a, b in zip(given, plain))
    defaults = entry(rewards, mask, settings=entry.settings(), **fields)
    assert not all(torch.equal(a, b) for a, b in zip(given, defaults))  # the values reach the function


def test_settings_of_another_estimator_or_given_twice_are_a_type_error():
    batch = build_batch(random_episodes(torch.Generator().manual_seed(4), 2, 2))
    rewards, mask = batch["token_level_rewards"], batch["response_mask"]
    with pytest.raises(TypeError, match="reinforce_plus_plus estimator takes DiscountSettings, got GAESettings"):
        get_estimator("reinforce_plus_plus")(rewards, mask, settings=GAESettings())
    with pytest.raises(TypeError, match="grpo estimator takes no settings, got DiscountSettings"):
        get_estimator("grpo")(rewards, mask, index=batch["index"], settings=DiscountSettings())
    with pytest.raises(TypeError, match="got gamma in settings and as keywords"):
        get_estimator("reinforce_plus_plus")(rewards, mask, settings=DiscountSettings(), gamma=0.5)


def test_settings_are_frozen_with_help_and_bounds():
    with pytest.raises(dataclasses.FrozenInstanceError):
        GAESettings().lam = 0.5  # type: ignore[misc]
    for cls in SETTINGS_CLASSES:
        for setting in dataclasses.fields(cls):
            assert setting.metadata["description"] and set(setting.metadata) <= {"description", "ge", "le"}
    # a setting that not every estimator with settings takes names the ones that do
    for setting in {f for cls in SETTINGS_CLASSES for f in dataclasses.fields(cls)} - set(
            dataclasses.fields(DiscountSettings)):
        takers = sorted(n for n, e in ESTIMATORS.items() if e.settings and setting in dataclasses.fields(e.settings))
        named = " and ".join(takers)
        assert f"(estimator{'s' * (len(takers) > 1)} {named} only)" in setting.metadata["description"], setting.name


def test_the_settings_import_without_torch():
    code = "import sys, advantages.settings; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert advantages.gigpo is advantages.turn_credit.gigpo  # the rest loads on first use
