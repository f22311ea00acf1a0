"""A record's ``info`` (how its episode was made) is assembled by one function (agent_loop/episode/info.py): the
loop's records, a failed episode's record and the proxy's records of the same episode carry the same keys (the
session id and segment number included), with the same values."""

import asyncio

from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.episode.info import episode_info
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.proxy.agents import stream_agent_rollouts
from agent_loop.runners.local import error_trajectory, stream_rollouts
from agent_loop.runners.spec import RunSpec
from agent_loop.tasks.registry import get_task
from tests.helpers.scripted_turns import turn_script


class Named:
    def __init__(self, name_or_path):
        self.name_or_path = name_or_path


def test_layout_order_and_what_may_replace_what(tmp_path):
    identity, extra = {"answer": 7}, {"expression": "3+4", "success": True}
    info = episode_info("arithmetic", 2, 5, success=False, tokenizer=Named(str(tmp_path)), identity=identity,
                        extra=extra)
    assert list(info) == ["task", "index", "seed", "answer", "success", "expression", "model_path"]
    assert info["success"] is True  # the episode's own info may replace the loop's keys, as it always could
    assert info["model_path"] == str(tmp_path.resolve()) and identity == {"answer": 7} and len(extra) == 2
    assert episode_info("t", 0, 0, success=False, tokenizer=Named("org/hub-model"))["model_path"] == "org/hub-model"
    assert "model_path" not in episode_info("t", 0, 0, success=True, tokenizer=Named(""))
    assert episode_info("t", 0, 0, success=True) == {"task": "t", "index": 0, "seed": 0, "success": True}


async def _agent(client, model, row):
    """One question, one answer (an openai-client agent through the proxy)."""
    await client.chat.completions.create(model=model, messages=row["messages"], tools=row["tools"])


def test_the_loop_a_failed_episode_and_the_proxy_record_the_same_keys(qwen_tokenizer):
    task = get_task("arithmetic")
    backend = ScriptedBackend(turn_script(qwen_tokenizer, ["I do not know."]))
    spec = RunSpec(task, qwen_tokenizer, [0, 1], LoopConfig(max_turns=2), 3, None, progress=False)

    async def play():
        played = (await stream_rollouts(spec, backend, keep=True))[1]
        proxied = (await stream_agent_rollouts(spec, backend, _agent, concurrency=1, keep=True))[1]
        return played, sorted(proxied, key=lambda t: t.info["index"])

    played, proxied = asyncio.run(play())
    failed = [error_trajectory(task, i, 3, "RuntimeError: x", qwen_tokenizer) for i in (0, 1)]
    episode_keys = set(task.make_episode(0, 3).info)
    for loop, proxy, error in zip(played, proxied, failed):
        assert set(loop.info) == {"task", "index", "seed", "answer", "session_id", "segment", "success", "model_path",
                                  "options"} | episode_keys
        assert set(error.info) == set(loop.info) - {"options"}  # "options": the runner's, for every record it writes
        assert set(proxy.info) == set(loop.info)  # one session, one segment: the same session id as the loop's
        assert (loop.session_id, loop.segment) == (proxy.session_id, proxy.segment) == (error.session_id, 0)
        for key in set(error.info) - {"success"}:
            assert loop.info[key] == error.info[key] == proxy.info[key], key
        assert not loop.info["success"] and not proxy.info["success"] and error.info["success"] is False
        assert loop.info["options"] == proxy.info["options"]
