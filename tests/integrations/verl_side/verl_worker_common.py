"""What the verl AgentLoopWorker scripts share (agent_loop_worker_run.py runs verl's worker in-process,
agent_loop_worker_ray_run.py as a Ray actor): the scripted token server, verl's composed trainer config with
the AgentLoop's lines, the rows and the DataProto dump.

Nothing of agent-loop is imported at module level, so a driver can use this without registering our AgentLoop
(the Ray script checks that the registry in its worker actor comes from ``VERL_USE_EXTERNAL_MODULES`` alone).
"""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import verl
from hydra import compose, initialize_config_dir
from verl.protocol import DataProto
from verl.workers.rollout.replica import TokenOutput

RESPONSE_LENGTH, PROMPT_LENGTH = 192, 512
CODE_TABLE = {"river": 417, "stone": 902}
LOOKUP_SCHEMA = {"type": "function", "function": {
    "name": "code_lookup", "description": "Look up the code stored under a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string", "description": "The key."}},
                   "required": ["key"]}}}


class ScriptedServer:
    """``generate(request_id, prompt_ids=, sampling_params=)`` -> TokenOutput, as verl's server manager."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from agent_loop.backends.scripted import scripted_logprob  # not at module level (see the docstring)

        self.calls.append({"request_id": request_id, "prompt_len": len(prompt_ids),
                           "sampling_params": dict(sampling_params)})
        text = self.tokenizer.decode(prompt_ids)
        last_user = text.rsplit("<|im_start|>user\n", 1)[-1]
        if "<tool_response>" in last_user:
            value = re.search(r"<tool_response>\n(.*?)\n</tool_response>", last_user, re.S).group(1)
            reply = f"The answer is {value}.<|im_end|>"
        elif m := re.search(r'What is the code of "(\w+)"\?', last_user):
            reply = '<tool_call>\n{"name": "code_lookup", "arguments": {"key": "%s"}}\n</tool_call><|im_end|>' % m[1]
        elif m := re.search(r"What is ([0-9+\-*]+)\?", last_user):
            reply = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call><|im_end|>' % m[1]
        else:
            reply = " word" * 1000
        ids = self.tokenizer.encode(reply, add_special_tokens=False)[: sampling_params["max_tokens"]]
        return TokenOutput(token_ids=ids, log_probs=[scripted_logprob(t) for t in ids], num_preempted=0)


def model_dir(tokenizer_dir: Path, work: Path) -> Path:
    """The test tokenizer plus a config.json: what verl's HFModelConfig loads (no weights are needed)."""
    folder = work / "model"
    shutil.copytree(tokenizer_dir, folder, dirs_exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 4096}))
    return folder


def trainer_config(model: Path, work: Path):
    """verl's own ppo_trainer config, composed by hydra as main_ppo does, with the AgentLoop's lines."""
    (work / "tools.yaml").write_text(json.dumps({"tools": [{
        "class_name": "verl_side_tools.CodeLookupTool", "config": {"type": "native", "step_reward": 0.5},
        "tool_schema": LOOKUP_SCHEMA}]}))
    (work / "agent_loops.yaml").write_text(json.dumps([
        {"name": "agent_loop_arith", "_target_": "agent_loop.integrations.verl_agent_loop.AgentLoop",
         "task": "arithmetic", "reward": None},
        {"name": "agent_loop_verl_reward", "_target_": "agent_loop.integrations.verl_agent_loop.AgentLoop",
         "reward_source": "verl"},
        {"name": "agent_loop_bad", "_target_": "agent_loop.integrations.verl_agent_loop.AgentLoop",
         "max_turn": 3},
    ]))
    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose("ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model}",
            f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
            f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "actor_rollout_ref.rollout.agent.default_agent_loop=agent_loop",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={work / 'agent_loops.yaml'}",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={work / 'tools.yaml'}",
            "+agent_loop.reward=number",
        ])


def row(prompt: str, index: int, ground_truth, agent_name: str) -> dict:
    return {"raw_prompt": [{"role": "user", "content": prompt}], "index": index, "agent_name": agent_name,
            "reward_model": {"ground_truth": ground_truth, "style": "rule"}, "data_source": "test",
            "extra_info": {"index": index},
            "tools_kwargs": {"code_lookup": {"create_kwargs": {"table": CODE_TABLE}}}}


def batch_of(rows: list[dict]) -> DataProto:
    columns = {}
    for key in rows[0]:
        columns[key] = np.empty(len(rows), dtype=object)  # filled in place: lists stay one object per row
        columns[key][:] = [r[key] for r in rows]
    return DataProto.from_dict(non_tensors=columns, meta_info={"validate": False, "global_steps": 1})


def plain(value):
    return value.item() if hasattr(value, "item") else str(value)  # numpy scalars (verl's __num_turns__ is int32)


def dump(output: DataProto) -> dict:
    keys = ("spans", "turn_ids", "tool_calls", "messages", "finish_reason", "truncated", "reward_source",
            "agent_loop_reward", "tool_rewards", "turn_scores", "__num_turns__")
    return {"batch": {k: v.tolist() for k, v in output.batch.items()},
            "non_tensor": {k: [json.loads(json.dumps(x, default=plain)) for x in output.non_tensor_batch[k]]
                           for k in keys},
            "meta_keys": sorted(output.meta_info)}
