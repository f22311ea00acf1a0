"""Asynchronous training (``--max-staleness K``, agent_loop/runners/producer.py).

Loop logic, with scripted replies on the real Qwen2.5 tokenizer and chat template and tools that wait on the
test: the backend's gate (a swap waits for the request in flight, a request asked for during a swap gets the
new weights), partial rollouts recording each token's version exactly at the switch, the staleness rule step
by step (a group older than K is dropped, counted and marked, never handed over; nothing is lost), and a
seeded random schedule checked against a plain serial account of every episode; a producer resumed from a
checkpoint's position plays its pending groups first, then goes on (an older checkpoint: from step x groups).

The real thing, on the tiny agent: a staleness-0 asynchronous run equals the synchronous one (same episodes,
bit-equal weights after 2 steps); a K = 1 run with a slow tool trains on partial rollouts whose every token's
sampling logprob is that of the weights of the version it records (and not the other version's), trains on
nothing older than K, and logs the staleness and producer metrics every step to metrics.jsonl and
TensorBoard; a run stopped after its step-2 checkpoint and resumed plays the same questions as a run that
never stopped, none twice; ``off_policy`` is refused, naming ``max_staleness 1``. The in-process vLLM
engine: tests/training/test_async_vllm.py.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
import threading
import time
import warnings

import pytest
import torch

from agent_loop import TrainConfig, Trainer
from agent_loop.backends.base import Backend, GenerationResult, SamplingParams
from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.cli.train import main as train_main
from agent_loop.episode.contracts import Task
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.options import checked
from agent_loop.runners.local import read_trajectories
from agent_loop.runners.producer import RolloutProducer, VersionedBackend, oldest_version
from agent_loop.tasks.grouping import GroupedTask
from agent_loop.types import Episode
from masking import SpanKind
from tests.helpers.async_training import WAIT_S, ToolsAfterTheFirstPush, small_config, token_logprobs

A, O = SpanKind.ASSISTANT, SpanKind.OBSERVATION


# -- loop logic: scripted replies, tools that wait on the test ------------------------------------------------


class Gates:
    """One threading.Event per episode index; the ``wait`` tool of episode ``i`` blocks on gate ``i``."""

    def __init__(self):
        self.events: dict[int, threading.Event] = {}
        self.waiting: set[int] = set()
        self.lock = threading.Lock()

    def gate(self, index: int) -> threading.Event:
        with self.lock:
            return self.events.setdefault(index, threading.Event())

    def open(self, *indices: int) -> None:
        for index in indices:
            self.gate(index).set()

    def wait_until_waiting(self, *indices: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not set(indices) <= self.waiting:
            assert time.monotonic() < deadline, f"episodes {sorted(set(indices) - self.waiting)} never reached the tool"
            time.sleep(0.005)


class GatedTask(Task):
    """Episode ``i``: "Episode i: wait."; its ``wait(index)`` tool blocks until the test opens gate ``i``."""

    name = "gated"

    def __init__(self, gates: Gates):
        self.gates = gates

    def make_episode(self, index, seed=0):
        def wait(index: int) -> str:
            """Wait for the test.

            Args:
                index: The episode.
            """
            self.gates.waiting.add(index)
            self.gates.gate(index).wait(60)
            return "go"

        return Episode(messages=[{"role": "user", "content": f"Episode {index}: wait."}], tools=[wait], answer="done")

    def reward(self, episode, messages, tool_calls):
        return float("done" in messages[-1]["content"])


def gated_script(tokenizer):
    """Turn 0: call ``wait`` with the episode's index (read from the prompt); turn 1: answer "done"."""
    def script(prompt_ids):
        text = tokenizer.decode(prompt_ids)
        if "<tool_response>" in text:
            return tokenizer.encode("done", add_special_tokens=False)
        index = int(text.split("Episode ")[1].split(":")[0])
        call = json.dumps({"name": "wait", "arguments": {"index": index}})
        return tokenizer.encode(f"<tool_call>\n{call}\n</tool_call>", add_special_tokens=False)
    return script


def wait_finished(producer, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while producer.counts["finished"] < n:
        assert time.monotonic() < deadline, f"only {producer.counts['finished']} of {n} episodes finished"
        time.sleep(0.005)


def producer_for(tokenizer, gates, *, max_staleness, group_size=1, groups_per_step=2, concurrency=8):
    backend = VersionedBackend(ScriptedBackend(gated_script(tokenizer)))
    task = GroupedTask(GatedTask(gates), group_size, question_seed=0)
    return RolloutProducer(task, backend, tokenizer, LoopConfig(max_turns=2), seed=0, concurrency=concurrency,
                           group_size=group_size, groups_per_step=groups_per_step, max_staleness=max_staleness)


def assert_versions_switch_after_the_observation(trajectory, first: int, second: int) -> None:
    """Turn 0's ASSISTANT tokens carry ``first``, its observation -1, turn 1's ASSISTANT tokens ``second``."""
    expected = [-1 if span == O else (first if turn == 0 else second)
                for span, turn in zip(trajectory.spans, trajectory.turn_ids)]
    assert trajectory.policy_versions == expected
    assert set(trajectory.turn_ids) == {0, 1} and A in trajectory.spans and O in trajectory.spans


def test_a_swap_waits_for_the_request_in_flight_and_requests_during_it_get_the_new_weights():
    class Held(Backend):
        def __init__(self):
            self.release, self.calls, self.loaded = asyncio.Event(), 0, []

        async def generate(self, prompt_ids, sampling, session_id=None):
            self.calls += 1
            await self.release.wait()
            return GenerationResult([7], [-0.5], "length")

    async def scenario():
        inner = Held()
        backend = VersionedBackend(inner)
        first = asyncio.create_task(backend.generate([1], SamplingParams(max_tokens=1)))
        await asyncio.sleep(0.01)
        swap = asyncio.create_task(backend.swap(lambda: inner.loaded.append(backend.version), 1))
        await asyncio.sleep(0.05)
        assert not swap.done() and inner.loaded == []  # the weights wait for the request in flight
        second = asyncio.create_task(backend.generate([2], SamplingParams(max_tokens=1)))
        await asyncio.sleep(0.05)
        assert inner.calls == 1  # asked for during the swap: not sent yet
        inner.release.set()
        results = await asyncio.gather(first, swap, second)
        return results, inner

    (first, _, second), inner = asyncio.run(scenario())
    assert inner.loaded == [0]  # loaded once the request in flight had finished, before the version moved
    assert (first.policy_version, second.policy_version) == (0, 1)
    assert first.token_ids == [7] and first.logprobs == [-0.5]  # the inner result, stamped

    async def failing():
        backend = VersionedBackend(Held())
        with pytest.raises(RuntimeError, match="sync failed"):
            await backend.swap(lambda: (_ for _ in ()).throw(RuntimeError("sync failed")), 1)
        return backend

    backend = asyncio.run(failing())
    assert backend.version == 0 and not backend._swapping  # a failed load keeps the version; the gate reopens


def test_partial_rollouts_record_each_tokens_version_exactly_at_the_switch(qwen_tokenizer):
    gates = Gates()
    producer = producer_for(qwen_tokenizer, gates, max_staleness=1)
    try:
        gates.wait_until_waiting(0, 1, 2, 3)  # K = 1: steps 0 and 1 (2 groups each) started under version 0
        time.sleep(0.1)
        assert producer.counts["started"] == 4  # the budget: (version 0 + K + 1) x 2 groups
        producer.push(None, 1)  # new weights while every episode waits in its tool
        gates.open(0, 1, 2, 3)
        wait_finished(producer, 4)
        taken, stale, metrics = producer.take(1)
    finally:
        producer.close()
    assert [t.info["index"] for t in taken] == [0, 1] and stale == [] and metrics["episodes/dropped_stale"] == 0
    for trajectory in taken:  # turn 0 sampled by version 0, turn 1 (after the push) by version 1
        assert_versions_switch_after_the_observation(trajectory, 0, 1)
        assert trajectory.finish_reason == "stop" and trajectory.reward == 1.0
        assert oldest_version(trajectory, 99) == 0
    assert not producer._thread.is_alive()


def test_a_producer_stuck_in_its_teardown_is_left_behind_with_where_it_waits(qwen_tokenizer):
    """A backend whose end of run never returns and swallows every cancel: close() returns after its bound, with
    a warning that names the call the thread waits in (the end of a training run never hangs on it)."""
    class EndRunNeverReturns(ScriptedBackend):
        async def end_run(self) -> None:
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    pass

    backend = VersionedBackend(EndRunNeverReturns(gated_script(qwen_tokenizer)))
    gates = Gates()
    producer = RolloutProducer(GroupedTask(GatedTask(gates), 1, question_seed=0), backend, qwen_tokenizer,
                               LoopConfig(max_turns=2), seed=0, concurrency=2, group_size=1, groups_per_step=2,
                               max_staleness=0)
    gates.wait_until_waiting(0, 1)
    started = time.perf_counter()
    with pytest.warns(RuntimeWarning, match=r"did not end within 0.5 s of close\(\)(.|\n)*in end_run"):
        producer.close(timeout_s=0.5)
    assert time.perf_counter() - started < WAIT_S
    assert producer._thread.is_alive()  # left behind: a daemon thread
    assert producer._thread.daemon


def test_a_group_older_than_k_is_dropped_counted_marked_and_nothing_is_lost(qwen_tokenizer):
    """K = 1, 2 groups per step, single-episode groups; episode 3 is held back across two pushes."""
    gates = Gates()
    producer = producer_for(qwen_tokenizer, gates, max_staleness=1)
    try:
        gates.wait_until_waiting(0, 1, 2, 3)
        gates.open(0, 1, 2)
        wait_finished(producer, 3)
        step0, stale0, _ = producer.take(0)
        producer.push(None, 1)  # 2 more groups allowed: episodes 4 and 5 start under version 1
        gates.wait_until_waiting(4, 5)
        gates.open(4, 5)
        wait_finished(producer, 5)
        step1, stale1, _ = producer.take(1)  # the lowest complete groups: 2 (version 0: 1 behind) and 4
        producer.push(None, 2)
        gates.wait_until_waiting(6, 7)
        gates.open(3, 6, 7)  # episode 3 finishes its second turn under version 2: its oldest token is 2 behind
        wait_finished(producer, 8)
        step2, stale2, metrics = producer.take(2)
        gates.wait_until_waiting(8)  # the dropped group's place in the budget went to a new one
        counts = dict(producer.counts)
    finally:
        gates.open(*range(20))
        producer.close()
    assert [[t.info["index"] for t in s] for s in (step0, step1, step2)] == [[0, 1], [2, 4], [5, 6]]
    assert stale0 == stale1 == [] and [t.info["index"] for t in stale2] == [3]
    assert stale2[0].info["stale"] == 2 and metrics["episodes/dropped_stale"] == 1.0
    assert_versions_switch_after_the_observation(stale2[0], 0, 2)  # a partial rollout across two updates
    for version, step in enumerate((step0, step1, step2)):
        assert all(oldest_version(t, -1) >= version - 1 for t in step)  # never older than K
    # every episode started is taken, dropped, waiting or in flight
    assert counts["started"] == 9 and counts["taken"] == 6 and counts["dropped_stale"] == 1
    assert counts["finished"] == counts["taken"] + counts["dropped_stale"] + 1  # episode 7 waits for a step
    # at the hand-over: 7 waits, none plays (8 starts once the drop has freed its place in the budget)
    assert metrics["producer/waiting"] == 1.0 and metrics["producer/in_flight"] == 0.0


def test_a_step_waiting_on_a_dropped_groups_replacement_gets_it(qwen_tokenizer):
    """The only complete group at a take is stale: dropping it must let the producer start its replacement
    while the trainer waits (the step's episodes can come from nowhere else: episode 3 is held)."""
    gates = Gates()
    producer = producer_for(qwen_tokenizer, gates, max_staleness=1, groups_per_step=1)
    try:
        gates.wait_until_waiting(0, 1)  # the budget: (0 + 1 + 1) x 1 group
        gates.open(0, 4)  # 4, the replacement to come, will not wait in its tool
        wait_finished(producer, 1)
        assert [t.info["index"] for t in producer.take(0)[0]] == [0]
        producer.push(None, 1)
        gates.wait_until_waiting(2)
        gates.open(2)
        wait_finished(producer, 2)
        assert [t.info["index"] for t in producer.take(1)[0]] == [2]
        producer.push(None, 2)
        gates.wait_until_waiting(3)  # held to the end
        gates.open(1)  # finishes under version 2, its oldest token from version 0: stale at step 2
        wait_finished(producer, 3)
        result = []
        taking = threading.Thread(target=lambda: result.append(producer.take(2)), daemon=True)
        taking.start()
        taking.join(30)
        assert result, "the take waited forever: the dropped group's place was never given to a new one"
        taken, stale, metrics = result[0]
    finally:
        gates.open(*range(10))
        producer.close()
    assert [t.info["index"] for t in taken] == [4] and [t.info["index"] for t in stale] == [1]
    assert metrics["episodes/dropped_stale"] == 1.0 and oldest_version(taken[0], -1) == 2


@pytest.mark.parametrize("max_staleness, group_size", [(1, 1), (2, 2)])
def test_a_random_schedule_never_trains_on_an_episode_older_than_k(qwen_tokenizer, max_staleness, group_size):
    """Seeded random tool delays (some long: they go stale), 8 steps; each step's groups are whole, fresh
    enough and new; a serial account of every index agrees with the producer's counts."""
    rng = random.Random(max_staleness * 10 + group_size)
    delays = {i: (0.4 if rng.random() < 0.2 else rng.uniform(0.0, 0.05)) for i in range(400)}

    class Delayed(Gates):
        def gate(self, index):
            event = super().gate(index)
            threading.Timer(delays[index], event.set).start()
            return event

    producer = producer_for(qwen_tokenizer, Delayed(), max_staleness=max_staleness, group_size=group_size,
                            groups_per_step=3)
    seen, dropped = [], []
    try:
        for version in range(8):
            taken, stale, metrics = producer.take(version)
            groups = [t.info["index"] // group_size for t in taken]
            assert len(taken) == 3 * group_size and len(set(groups)) == 3
            assert all(groups.count(g) == group_size for g in groups)  # whole groups only
            assert all(version - oldest_version(t, -1) <= max_staleness for t in taken)
            assert all(t.info["stale"] > max_staleness for t in stale)
            seen += [t.info["index"] for t in taken]
            dropped += [t.info["index"] for t in stale]
            time.sleep(0.03)  # a "training step"
            producer.push(None, version + 1)
        counts = dict(producer.counts)
    finally:
        producer.close()
    assert len(set(seen + dropped)) == len(seen) + len(dropped)  # no episode handed over twice
    assert counts["taken"] == len(seen) and counts["dropped_stale"] == len(dropped)
    assert counts["started"] >= counts["finished"] >= counts["taken"] + counts["dropped_stale"]
    assert dropped, "the schedule dropped nothing: the long delays are too short to test the rule"


@pytest.mark.parametrize("position, first_groups", [
    ({"next_group": 7, "pending": [6, 3]}, [3, 6, 7, 8]),  # a checkpoint's: its pending groups first, then 7 on
    (None, [4, 5, 6, 7]),  # none (an older checkpoint): from step x groups per step
])
def test_a_resumed_producer_plays_its_pending_groups_first_then_goes_on(qwen_tokenizer, position, first_groups):
    """Resumed after step 2 (2 groups a step, 1 episode a group, K = 1): the budget is (2 + 1 + 1) x 2 groups
    of which 2 x 2 are trained on, so 4 groups start; ``position()`` follows them through a step."""
    gates = Gates()
    backend = VersionedBackend(ScriptedBackend(gated_script(qwen_tokenizer)), version=2)
    task = GroupedTask(GatedTask(gates), 1, question_seed=0)
    producer = RolloutProducer(task, backend, qwen_tokenizer, LoopConfig(max_turns=2), seed=0, concurrency=8,
                               group_size=1, groups_per_step=2, max_staleness=1, first_step=2, position=position)
    try:
        gates.wait_until_waiting(*first_groups)
        time.sleep(0.1)
        assert producer.counts["started"] == 4 and gates.waiting == set(first_groups)
        assert producer.position() == {"next_group": first_groups[-1] + 1, "pending": first_groups}
        gates.open(*first_groups)
        wait_finished(producer, 4)
        taken, stale, _ = producer.take(2)
        assert [t.info["index"] for t in taken] == first_groups[:2] and stale == []
        assert producer.position() == {"next_group": first_groups[-1] + 1, "pending": first_groups[2:]}
    finally:
        gates.open(*range(20))
        producer.close()


def test_a_checkpoints_producer_position_is_checked_and_an_older_checkpoint_has_none(tmp_path):
    from agent_loop.training.checkpoint import STATE_FILE, CheckpointError, load_state

    plain = {"step": 2, "optimizer": {}, "initial_model": "m", "config": {}, "rng": {}}
    torch.save(plain, tmp_path / STATE_FILE)  # an older checkpoint: no "producer"
    assert "producer" not in load_state(tmp_path)
    for fine in (None, {"next_group": 9, "pending": []}, {"next_group": 9, "pending": [0, 8]}):
        torch.save({**plain, "producer": fine}, tmp_path / STATE_FILE)
        assert load_state(tmp_path)["producer"] == fine
    for bad in ({"next_group": 9, "pending": [9]}, {"next_group": -1, "pending": []}, {"pending": []}, [9, []],
                {"next_group": 9, "pending": [1.5]}):
        torch.save({**plain, "producer": bad}, tmp_path / STATE_FILE)
        with pytest.raises(CheckpointError, match="invalid producer position"):
            load_state(tmp_path)


# -- the real thing: the tiny agent ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_staleness_0_asynchronous_run_equals_the_synchronous_one(tiny_mid, tmp_path):
    synchronous = Trainer(small_config(tiny_mid, tmp_path / "sync"))
    initial = [p.detach().clone() for p in synchronous.policy.parameters()]
    asynchronous = Trainer(small_config(tiny_mid, tmp_path / "async"))
    asynchronous.start_producer(0)
    try:
        history = {name: [trainer.train_step() for _ in range(2)]
                   for name, trainer in (("sync", synchronous), ("async", asynchronous))}
    finally:
        asynchronous.rollouts.close()
    for step in (1, 2):  # the same episodes, token for token (the step files hold them in index order)
        sync_file, async_file = (read_trajectories(tmp_path / name / "rollouts" / f"step_{step:06d}.jsonl")
                                 for name in ("sync", "async"))
        assert [t.info["index"] for t in async_file] == [t.info["index"] for t in sync_file] == \
            list(range((step - 1) * 8, step * 8))
        assert [t.response_ids for t in async_file] == [t.response_ids for t in sync_file]
        assert [t.policy_versions for t in async_file] == [t.policy_versions for t in sync_file]
        assert {v for t in async_file for v in t.policy_versions if v >= 0} == {step - 1}
    for a, b in zip(history["sync"], history["async"]):
        assert a["loss/first"] == b["loss/first"] and a["staleness/max"] == b["staleness/max"] == 0.0
    assert asynchronous.producer.counts["taken"] == 16
    for (name, p), q in zip(synchronous.policy.named_parameters(), asynchronous.policy.parameters()):
        assert torch.equal(p, q), name  # the same updates: bit-equal weights
    assert all(not torch.equal(p, q) for p, q in zip(synchronous.policy.parameters(), initial))  # they did train


def played_questions(out) -> list[int]:
    """The questions (groups) of every episode in the run's step files, trained on or dropped as stale."""
    return [t.info["group"] for path in sorted((out / "rollouts").glob("step_*.jsonl"))
            for t in read_trajectories(path)]


@pytest.mark.slow
def test_a_resumed_asynchronous_run_plays_the_same_questions_none_twice(tiny_mid, tmp_path, monkeypatch):
    """K = 1, 4 questions a step: question 0 starts only once the weights are version 2 (a slow start), so at
    the step-2 checkpoint the stream is not "questions below 8 done": steps 1-2 trained on questions 1-8 while
    0 and 9-11 (at least) were in flight. A run of 4 steps, and the same run stopped after its step-2 checkpoint
    and resumed for the last 2, play the same questions (0-15), each once; a resume restarting at
    step x prompts_per_step would play 8 again and never 0."""
    import agent_loop.runners.local as local  # the one worker pool (the producer's too) plays with its play_episode

    play = local.play_episode

    async def late_question_0(task, index, backend, *args):
        while index // 2 == 0 and backend.version < 2:
            await asyncio.sleep(0.01)
        return await play(task, index, backend, *args)

    monkeypatch.setattr(local, "play_episode", late_question_0)
    config = functools.partial(small_config, tiny_mid, steps=4, max_staleness=1, save_every=2)
    whole = Trainer(config(tmp_path / "whole"))
    whole.train()

    stopped = Trainer(config(tmp_path / "stopped"))
    try:  # what train() does up to its step-2 checkpoint; then the run stops (as if killed)
        stopped.train_step()
        stopped.train_step()
        stopped.save_checkpoint()
    finally:
        stopped.rollouts.close()
    state = torch.load(tmp_path / "stopped" / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=True)
    # which 8 questions steps 1-2 trained on depends on which episodes the backend finished first (requests join
    # and leave its batch as they come); question 0 was still in flight, whatever the order
    pending, trained = set(state["producer"]["pending"]), played_questions(tmp_path / "stopped")
    assert state["producer"]["next_group"] >= 12 and 0 in pending and len(pending) >= 4
    assert sorted(trained) == [q for q in sorted(set(trained)) for _ in range(2)] and len(set(trained)) == 8
    assert not pending & set(trained) and 0 not in trained
    resumed = Trainer(config(tmp_path / "stopped", resume=str(tmp_path / "stopped")))
    resumed.train()
    assert resumed.step == 4

    for out in (tmp_path / "whole", tmp_path / "stopped"):
        questions = played_questions(out)
        assert sorted(questions) == [q for q in range(16) for _ in range(2)], out  # each question once (2 samples)
    assert sorted(played_questions(tmp_path / "whole")) == sorted(played_questions(tmp_path / "stopped"))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:lr .* is known to be unstable", "ignore:step .* has no learning signal")
def test_k1_trains_on_partial_rollouts_sampled_by_the_versions_they_record(tiny_mid, tmp_path):
    """A large learning rate on purpose: one update moves the logprobs well beyond the sampler's rounding."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM

    config = small_config(tiny_mid, tmp_path / "run", steps=4, max_staleness=1, lr=1e-3, warmup_steps=0, mini_batches=1,
                          tensorboard=True, eval_every=2, eval_episodes=8, tool_timeout_s=2 * WAIT_S)
    task = ToolsAfterTheFirstPush(config.rollout.prompts_per_step)
    trainer = Trainer(config, task=task)
    states = {0: {k: v.clone() for k, v in trainer.policy.state_dict().items()}}
    push = task.held(trainer.producer.push)  # the first push waits for a second-step episode's tool call

    def recording(load, version):
        states[version] = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
        push(load, version)

    trainer.producer.push = recording
    history = trainer.train()
    assert not trainer.producer._thread.is_alive()  # train() stopped the producer

    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3, 4]  # step 0: the evaluation before training
    assert all("eval/success" in lines[step] for step in (0, 2, 4))  # played on the producer's loop
    for metrics in lines[1:]:
        for name in ("staleness/k0", "staleness/k1", "staleness/mean", "staleness/max", "episodes/dropped_stale",
                     "time/idle_s", "producer/episodes_per_s", "producer/in_flight"):
            assert name in metrics and math.isfinite(metrics[name]), (name, metrics)
        assert metrics["staleness/max"] <= 1 and metrics["staleness/k0"] + metrics["staleness/k1"] == 8
    assert sum(m["staleness/k1"] for m in history) > 0  # it did train on older episodes
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("staleness/mean")] == [1, 2, 3, 4]
    assert len(events.Scalars("producer/episodes_per_s")) == 4

    model = AutoModelForCausalLM.from_pretrained(tiny_mid, dtype=torch.float32).eval()
    partial, own, others = 0, [], []  # |sampled - recomputed| with the token's own version's weights, the other's
    for step in range(1, 5):
        for trajectory in read_trajectories(tmp_path / "run" / "rollouts" / f"step_{step:06d}.jsonl"):
            versions = torch.tensor(trajectory.policy_versions)
            lag = step - 1 - oldest_version(trajectory, -1)
            if "stale" in trajectory.info:  # dropped, written to the step's file but never trained on
                assert trajectory.info["stale"] > 1 and not trajectory.info["trained"]
                continue
            assert lag <= 1  # nothing older than K was trained on
            sampled = torch.tensor(trajectory.logprobs, dtype=torch.float64)
            present = sorted({int(v) for v in versions if v >= 0})
            partial += len(present) > 1
            by_version = {}
            for version in present:
                model.load_state_dict(states[version])
                by_version[version] = token_logprobs(model, trajectory)
            for version in present:
                mine = versions == version
                own.append((by_version[version][mine] - sampled[mine]).abs())
                others += [(by_version[other][mine] - sampled[mine]).abs() for other in present if other != version]
    assert partial > 0, "no episode ran across a weight update: no second-step episode called a tool"
    own, others = torch.cat(own), torch.cat(others)
    assert own.numel() > 100 and own.max() < 2e-3  # every token: the logprob of the weights its version names
    assert others.mean() > 10 * own.mean()  # and not the other version's (one update moved them)


def test_off_policy_is_refused_naming_max_staleness(tmp_path, capsys):
    """An option of an earlier version is refused in one line that names its replacement (issue 55 item 2)."""
    assert train_main(["--off-policy", "--output-dir", str(tmp_path / "a")]) == 2
    assert "--off-policy: no longer an option; use --max-staleness 1" in capsys.readouterr().err
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert checked(TrainConfig.from_flat(max_staleness=2, output_dir=str(tmp_path))).rollout.max_staleness == 2
    assert train_main(["--max-staleness", "-1"]) == 2  # a usage error: one line, exit 2
