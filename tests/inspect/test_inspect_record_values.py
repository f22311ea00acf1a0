"""Records whose values are of the wrong kind (issue 30, "trust nothing that comes back"): a reward written as
``null`` (a NaN repaired by the strict writer) or a string, ids that are not integers, a NaN logprob in a file
from before strict JSON. ``Trajectory.check`` refuses each with a ValueError naming the field, so inspect shows
the good lines and warns about the others, in every view, instead of a traceback."""

import json

import pytest

from agent_loop.cli.inspect import main
from agent_loop.types import Trajectory


def good(index: int, **fields) -> dict:
    record = dict(prompt_ids=[1, 2], response_ids=[3, 4, 5], spans=[1, 2, 1], turn_ids=[0, 0, 1],
                  logprobs=[-0.5, 0.0, -0.25], messages=[{"role": "user", "content": "q"}], reward=1.0,
                  info={"task": "t", "index": index, "seed": 0})
    record.update(fields)
    return record


BAD = {  # field values a hand edit, another program or an old writer leaves, and what check() says
    "reward": (None, "reward None is not a finite number"),
    "logprobs": ([-0.5, 0.0, float("nan")], "logprobs holds a value that is not a finite number"),
    "response_ids": ([3, "4", 5], "response_ids holds a value that is not an integer"),
    "turn_rewards": ([0.5, None], "turn_rewards holds a value that is not a finite number"),
    "info": ([1, 2], "finish_reason must be a string, info and metrics JSON objects"),
}


@pytest.mark.parametrize("field", BAD)
def test_check_names_a_value_of_the_wrong_kind(field):
    value, message = BAD[field]
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        Trajectory.from_dict(good(0, **{field: value})).check()
    Trajectory.from_dict(good(0, reward=2, turn_rewards=[0.5, 0])).check()  # ints are numbers


def test_reward_as_a_string_is_refused_too():
    with pytest.raises(ValueError, match="reward 'high' is not a finite number"):
        Trajectory.from_dict(good(0, reward="high")).check()


@pytest.mark.parametrize("view", [[], ["--all", "--values"], ["--worst", "2"], ["--compare"]])
def test_inspect_shows_the_good_records_and_warns_about_the_others(tmp_path, capsys, view):
    """The probe: a record with reward null (a NaN reward, repaired when written) or "high" made inspect crash
    with a TypeError in its summary."""
    path = tmp_path / "run.jsonl"
    lines = [json.dumps(good(0)), json.dumps(good(1, reward=None)), json.dumps(good(2, reward="high")),
             json.dumps(good(3, response_ids=[3, "4", 5])), json.dumps(good(4))]
    path.write_text("\n".join(lines) + "\n")
    assert main([str(path), "--width", "120", *view]) == 0
    captured = capsys.readouterr()
    assert f"{path}: 2 episodes" in captured.out and "Traceback" not in captured.err
    assert f"{path}:2: not a Trajectory: reward None is not a finite number" in captured.err
    assert f"{path}:3: not a Trajectory: reward 'high' is not a finite number" in captured.err
    assert f"{path}:4: not a Trajectory: response_ids holds a value that is not an integer" in captured.err
