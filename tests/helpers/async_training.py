"""A small asynchronous training run, an arithmetic task whose calls wait for the first push, and a model's
response logprobs (tests/training/test_async_training.py, tests/training/test_async_vllm.py)."""

import functools
import threading

import torch

from agent_loop import TrainConfig
from agent_loop.episode.contracts import Task
from agent_loop.tasks.registry import get_task

WAIT_S = 300.0  # the longest wait for the first push, or for a call before it (a training step on a slow CPU)
TRAIN_SEED = 0  # small_config's


def small_config(tiny_mid: str, out, **overrides) -> TrainConfig:
    """8 episodes per step (4 questions x 2 samples), 2 mini-batches."""
    settings = dict(model=tiny_mid, steps=2, prompts_per_step=4, group_size=2, concurrency=8, mini_batches=2,
                    micro_batch_size=4, threads=1, output_dir=str(out), progress=False, entropy_coef=0.01,
                    tensorboard=False, save_every=100)
    settings.update(overrides)
    return TrainConfig.from_flat(**settings)


class ToolsAfterTheFirstPush(Task):
    """The arithmetic task whose tool calls, in questions ``first_questions`` and later, set ``calling`` and wait
    until ``pushed`` is set; the test pushes the first new weights only once such a call waits, then sets
    ``pushed``. That episode has sampled with version 0 before its call and samples with version 1 after it,
    whatever the machine's speed. The first step's questions never wait (the first push follows their training),
    and the staleness bound admits no question beyond the second step's before that push; nor do train's
    held-out questions (their own stream, seed + 1,000,003), so an evaluation before the push goes on."""

    name = "arithmetic"

    def __init__(self, first_questions: int):
        self.task = get_task("arithmetic")
        self.first_questions, self.calling, self.pushed = first_questions, threading.Event(), threading.Event()

    def make_episode(self, index, seed=0):
        episode = self.task.make_episode(index, seed)  # index: the question (the trainer's groups)
        if index >= self.first_questions and seed == TRAIN_SEED:
            episode.tools = [self.after_push(tool) for tool in episode.tools]
        return episode

    def held(self, push):
        """The producer's ``push``, holding the first new weights until a call waits, then letting the call go on
        (its next turn samples with the new weights)."""
        def holding(load, version):
            if version >= 1 and not self.pushed.is_set():
                self.calling.wait(WAIT_S)
            push(load, version)
            if version >= 1:
                self.pushed.set()
        return holding

    def after_push(self, tool):
        @functools.wraps(tool)
        def waiting(*args, **kwargs):
            self.calling.set()
            self.pushed.wait(WAIT_S)
            return tool(*args, **kwargs)
        return waiting

    def reward(self, episode, messages, tool_calls):
        return self.task.reward(episode, messages, tool_calls)


def token_logprobs(model, trajectory) -> torch.Tensor:
    """The model's logprob of each response token (one unpadded forward)."""
    ids = torch.tensor([trajectory.prompt_ids + trajectory.response_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
    p = len(trajectory.prompt_ids)
    return logprobs[p - 1:].gather(1, torch.tensor(trajectory.response_ids).unsqueeze(1))[:, 0]
