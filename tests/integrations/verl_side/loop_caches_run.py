"""The verl AgentLoop's per-config caches (agent_loop/integrations/verl_agent_loop.py), in verl's real
``AgentLoopWorker`` (verl 0.9.1 side environment): tests/integrations/test_verl_loop_caches.py runs this with the
test tokenizer's folder and a work folder, and reads ``result.json``.

Checked here and written as booleans/values: AgentLoops made as verl's worker makes them (``hydra.utils.instantiate``
with the worker's objects) take verl's base attributes from one ``AgentLoopBase.__init__`` per config, with the
same attributes and values a fresh ``__init__`` gives, their own event loop and dicts; a changed config object gets
a new entry; rows' tasks are those a fresh ``DatasetTask`` per row gives (episode, reward) and share no mutable
state; a played batch keeps one ``tool_rewards`` list and one messages list per row.
"""

import asyncio
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]

import hydra.utils  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl.experimental.agent_loop.agent_loop import (  # noqa: E402
    AgentLoopBase,
    AgentLoopWorker,
    DictConfigWrap,
    ToolListWrap,
    _agent_loop_registry,
)
from verl_worker_common import ScriptedServer, batch_of, model_dir, row, trainer_config  # noqa: E402

from agent_loop.episode.tools import Tool  # noqa: E402
from agent_loop.integrations import verl_agent_loop as module  # noqa: E402
from agent_loop.tasks.dataset import DatasetTask  # noqa: E402


def make_loop(worker, config=None):
    """An AgentLoop as verl's ``_run_agent_loop`` makes one (its arguments, hydra's instantiate)."""
    return hydra.utils.instantiate(
        config=_agent_loop_registry["agent_loop"], trainer_config=DictConfigWrap(config=config or worker.config),
        server_manager=worker.llm_client, tokenizer=worker.tokenizer, processor=worker.processor,
        hf_model_type=worker.hf_model_type, dataset_cls=worker.dataset_cls,
        data_config=DictConfigWrap((config or worker.config).data), tools=ToolListWrap(worker.tools))


def fresh_base(worker) -> dict:
    """The attributes verl's own ``AgentLoopBase.__init__`` gives, on a bare object."""
    bare = object.__new__(module.AgentLoop)
    AgentLoopBase.__init__(bare, trainer_config=DictConfigWrap(config=worker.config), server_manager=worker.llm_client,
                           tokenizer=worker.tokenizer, processor=worker.processor, dataset_cls=worker.dataset_cls,
                           data_config=DictConfigWrap(worker.config.data), hf_model_type=worker.hf_model_type)
    return vars(bare)


def same_value(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if hasattr(a, "__dict__") and not isinstance(a, type):  # the Continuous Token builder: same settings
        return vars(a).keys() == vars(b).keys() and all(vars(a)[k] is vars(b)[k] or vars(a)[k] == vars(b)[k]
                                                        for k in vars(a))
    return a is b or a == b


async def main(tokenizer_dir: Path, work: Path) -> None:
    config = trainer_config(model_dir(tokenizer_dir, work), work)
    worker = AgentLoopWorker(config, ScriptedServer(None))
    worker.llm_client.tokenizer = worker.tokenizer
    result = {}

    # verl's base attributes: one __init__ per config, the same values as verl's own __init__
    module._BASES.clear()
    first, second = make_loop(worker), make_loop(worker)
    reference = fresh_base(worker)
    base_keys = sorted(reference)
    result["base_keys_match"] = all(k in vars(second) for k in base_keys)
    result["base_values_match"] = {k: same_value(getattr(second, k), reference[k]) for k in base_keys}
    result["base_entries_after_two_rows"] = len(module._BASES)
    result["event_loop_is_running_loop"] = second.loop is asyncio.get_running_loop()
    result["dict_attributes_shared"] = [k for k in base_keys if isinstance(getattr(first, k), dict)
                                        and getattr(first, k) is getattr(second, k)]
    changed = OmegaConf.create(OmegaConf.to_container(config, resolve=False))
    changed.data.apply_chat_template_kwargs = {"enable_thinking": False}
    third = make_loop(worker, changed)
    result["base_entries_after_changed_config"] = len(module._BASES)
    result["changed_config_reads_its_own"] = (third.apply_chat_template_kwargs == {"enable_thinking": False}
                                              and second.apply_chat_template_kwargs != {"enable_thinking": False})

    # the rows' tasks: a fresh DatasetTask's episode and reward, no shared mutable state
    rows = [row('What is the code of "river"?', i, "417", "agent_loop") for i in range(2)]
    rewards = [[], []]
    tools = [module.verl_tool_functions(second.verl_tools, r["tools_kwargs"], rewards[i]) for i, r in enumerate(rows)]
    tasks = [module.episode_for_row(second.options, r, t) for r, t in zip(rows, tools)]
    episodes = [t.episode for t in tasks]
    data = {"prompt": rows[0]["raw_prompt"], "answer": "417", "data_source": "test", "extra_info": {"index": 0}}
    fresh = DatasetTask([data], list(module._rewards(tuple(second.options.reward))), tools[0], name="verl")
    fresh_episode = fresh.make_episode(0)
    ours = tasks[0].task
    result["episode_matches_fresh_task"] = (
        episodes[0].messages == fresh_episode.messages and episodes[0].answer == fresh_episode.answer
        and [Tool.from_function(t).schema for t in episodes[0].tools]
        == [Tool.from_function(t).schema for t in fresh_episode.tools] and len(fresh_episode.tools) == 1
        and {k: v for k, v in episodes[0].info.items() if k in fresh_episode.info} == fresh_episode.info)
    reply = [*episodes[0].messages, {"role": "assistant", "content": "The answer is 417."}]
    result["reward_matches_fresh_task"] = [ours.reward(episodes[0], reply, []), fresh.reward(fresh_episode, reply, [])]
    result["task_attributes_match"] = sorted(k for k in vars(fresh) if k not in ("rows", "tools", "rewards")
                                             and vars(fresh)[k] != vars(ours)[k])
    result["reward_names_match"] = [n for n, *_ in ours.rewards] == [n for n, *_ in fresh.rewards]
    result["shared_between_rows"] = [name for name, a, b in (
        ("task", tasks[0].task, tasks[1].task), ("rows", tasks[0].task.rows, tasks[1].task.rows),
        ("task tools", tasks[0].task.tools, tasks[1].task.tools), ("episode", episodes[0], episodes[1]),
        ("messages", episodes[0].messages, episodes[1].messages), ("episode tools", episodes[0].tools, episodes[1].tools),
        ("info", episodes[0].info, episodes[1].info)) if a is b]
    result["row_indices"] = [e.info["verl_index"] for e in episodes]
    other = module._options(json.dumps({**second.settings.values, "reward": ["number", "number"],
                                        "reward_weights": [1.0, 0.5]}, sort_keys=True))
    other_task = module.episode_for_row(other, rows[0], []).task
    result["changed_reward_terms"] = [[n, w] for n, _, w, _ in other_task.rewards]

    # a played batch: one tool_rewards list and one messages list per row
    out = await worker.generate_sequences(batch_of(rows))
    tool_rewards, messages = out.non_tensor_batch["tool_rewards"], out.non_tensor_batch["messages"]
    result["tool_rewards"] = [list(map(float, r)) for r in tool_rewards]
    result["tool_rewards_shared"] = tool_rewards[0] is tool_rewards[1]
    result["messages_shared"] = messages[0] is messages[1]
    (work / "result.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2])))
