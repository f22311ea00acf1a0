"""A small asynchronous training run, a slowed arithmetic task, and a model's response logprobs
(tests/training/test_async_training.py, tests/training/test_async_vllm.py)."""

import functools
import time

import torch

from agent_loop import TrainConfig
from agent_loop.episode.contracts import Task
from agent_loop.tasks.registry import get_task


def small_config(tiny_mid: str, out, **overrides) -> TrainConfig:
    """8 episodes per step (4 questions x 2 samples), 2 mini-batches."""
    settings = dict(model=tiny_mid, steps=2, prompts_per_step=4, group_size=2, concurrency=8, mini_batches=2,
                    micro_batch_size=4, threads=1, output_dir=str(out), progress=False, entropy_coef=0.01,
                    tensorboard=False, save_every=100)
    settings.update(overrides)
    return TrainConfig.from_flat(**settings)


class SlowTools(Task):
    """The arithmetic task with every tool call taking ``delay_s`` more (episodes long enough to span a push)."""

    name = "arithmetic"

    def __init__(self, delay_s: float):
        self.task, self.delay_s = get_task("arithmetic"), delay_s

    def make_episode(self, index, seed=0):
        episode = self.task.make_episode(index, seed)
        episode.tools = [self.slowed(tool) for tool in episode.tools]
        return episode

    def slowed(self, tool):
        @functools.wraps(tool)
        def slow(*args, **kwargs):
            time.sleep(self.delay_s)
            return tool(*args, **kwargs)
        return slow

    def reward(self, episode, messages, tool_calls):
        return self.task.reward(episode, messages, tool_calls)


def token_logprobs(model, trajectory) -> torch.Tensor:
    """The model's logprob of each response token (one unpadded forward)."""
    ids = torch.tensor([trajectory.prompt_ids + trajectory.response_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
    p = len(trajectory.prompt_ids)
    return logprobs[p - 1:].gather(1, torch.tensor(trajectory.response_ids).unsqueeze(1))[:, 0]
