"""Warm start on demonstrations (agent_loop/recipes/warmstart.py; the library's agent_loop/training/demonstrations.py
and finetune.py) with the real tiny agent and its chat template.

Checks: a demonstration replays through the agent loop exactly as a model that wrote the same text would
(prompt ids, response ids, spans, messages); the tokens that get loss are the ASSISTANT ones and nothing
else (their text, and a gradient probe on the logits); the loss and its gradient equal a plain serial
per-token cross-entropy loop, micro-batched or not; bad demonstrations are refused naming the episode;
a short warm start lowers the loss and saves a model folder the loop loads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import agent_loop.training.checkpoint as checkpoint
from agent_loop import Environment
from agent_loop.backends.scripted import ScriptedBackend
from agent_loop.episode.contracts import Task, as_task
from agent_loop.episode.loop_config import LoopConfig
from agent_loop.model_folders import check_model_dir
from agent_loop.recipes.warmstart import lr_at, warm_start
from agent_loop.recipes.warmstart_options import WarmstartConfig
from agent_loop.runners.batch import trajectories_to_batch
from agent_loop.runners.local import run_rollouts
from agent_loop.tasks.registry import get_task
from agent_loop.training.demonstrations import DemonstrationError, has_demonstrations, replay
from agent_loop.training.finetune import assistant_mask, row_order, step_loss, summed_loss
from agent_loop.training.policy import PolicyModel
from masking import SpanKind

ASSISTANT, OBSERVATION = SpanKind.ASSISTANT, SpanKind.OBSERVATION


def double(number: int) -> str:
    """Double a number.

    Args:
        number: The number to double.
    """
    return str(2 * number)


def negate(number: int) -> str:
    """Negate a number.

    Args:
        number: The number to negate.
    """
    return str(-number)


class Quadruple(Environment):
    """Four times N with a doubling tool, called twice (two tool turns, then the answer)."""

    tools = [double, negate]

    def sample(self, rng):
        n = rng.randint(1, 99)
        return {"prompt": f"What is four times {n}?", "answer": str(4 * n), "n": n}

    def score(self, completion, answer):
        return float(completion == f"The answer is {answer}.")

    def demonstrate(self, episode, rng):
        n = episode.info["row"]["n"]
        return [{"role": "assistant", "content": "Let me check.", "tool_calls": [{"name": "double", "arguments": {"number": n}}]},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "double", "arguments": json.dumps({"number": 2 * n})}}]},
                {"role": "assistant", "content": f"The answer is {4 * n}."}]


def turn_texts(n: int) -> list[str]:
    """What a model writes in the tiny agent's template for Quadruple's demonstration of ``n`` (by hand)."""
    call = '<tool_call>\n{"name": "double", "arguments": {"number": %d}}\n</tool_call>'
    return ["Let me check.\n" + call % n, call % (2 * n), f"The answer is {4 * n}."]


@pytest.fixture(scope="module")
def demonstrations(tiny_tokenizer):
    return replay(Quadruple(), tiny_tokenizer, range(4), seed=3, progress=False)


def test_a_replayed_demonstration_is_what_the_loop_records_for_a_model_writing_it(tiny_tokenizer, demonstrations):
    task = Quadruple()

    def script(prompt):  # a model that writes the demonstration's turns as text
        text = tiny_tokenizer.decode(prompt)
        n = int(text.split("What is four times ")[1].split("?")[0])
        turn = text.count("<|im_start|>assistant") - 1
        return tiny_tokenizer.encode(turn_texts(n)[turn], add_special_tokens=False)

    played = asyncio.run(run_rollouts(task, ScriptedBackend(script), tiny_tokenizer, range(4), LoopConfig(), seed=3,
                                      progress=False))
    for replayed, loop in zip(demonstrations, played):
        assert replayed.prompt_ids == loop.prompt_ids and replayed.response_ids == loop.response_ids
        assert replayed.spans == loop.spans and replayed.turn_ids == loop.turn_ids
        assert replayed.messages == loop.messages and replayed.success and loop.success
        assert [c.result for c in replayed.tool_calls] == [c.result for c in loop.tool_calls]
        assert replayed.finish_reason == "stop" and replayed.metrics["template_exact"]


def test_the_replay_is_keyed_by_the_session_ids_the_loop_sends(tiny_tokenizer):
    """ReplayBackend's keys come from the loop's own function: each episode's requests arrive under its key, once
    per demonstrated turn, and no request arrives under another."""
    from agent_loop.training.demonstrations import ReplayBackend, prepare
    from agent_loop.types import episode_session_id

    task = as_task(Quadruple())
    prepared = [asyncio.run(prepare(task, index, 5, tiny_tokenizer)) for index in range(3)]
    keys = {episode_session_id(task.name, 5, d.index): d.turns for d in prepared}
    assert sorted(keys) == [f"{task.name}:5:{i}" for i in range(3)]  # the documented shape: name:seed:index
    backend = ReplayBackend(keys)
    played = asyncio.run(run_rollouts(task, backend, tiny_tokenizer, range(3), LoopConfig(), seed=5, progress=False))
    assert dict(backend.played) == {key: len(turns) for key, turns in keys.items()}
    assert all(t.finish_reason == "stop" and t.success for t in played)


def test_the_supervised_tokens_are_exactly_the_assistant_tokens(tiny_tokenizer, tiny_agent_dir, demonstrations):
    batch = trajectories_to_batch(demonstrations, pad_token_id=tiny_tokenizer.pad_token_id)
    mask = assistant_mask(batch)
    assert torch.equal(mask, batch.spans == ASSISTANT) and torch.equal(mask.float(), batch.response_mask)
    end = "<|im_end|>"
    for row, t in enumerate(demonstrations):
        n = t.info["row"]["n"]
        supervised = batch.responses[row][mask[row]].tolist()
        assert tiny_tokenizer.decode(supervised) == "".join(text + end for text in turn_texts(n))
        observed = batch.responses[row][batch.spans[row] == OBSERVATION].tolist()
        assert tiny_tokenizer.decode(observed) == "".join(
            f"\n<|im_start|>user\n<tool_response>\n{value}\n</tool_response>{end}\n<|im_start|>assistant\n"
            for value in (2 * n, 4 * n))
    # a gradient probe: only the logits of ASSISTANT positions reach the loss
    model = AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32)
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: seen.append(out) or out.retain_grad())
    summed_loss(PolicyModel(model, logits_chunk=mask.numel()), batch).backward()  # the head in one piece
    grad = seen[0].grad.view(*mask.shape, -1)  # the forward's logits (backward recomputes the piece: seen[1])
    assert torch.equal(grad.abs().sum(-1) > 0, mask)


def serial_reference(model, demonstrations) -> torch.Tensor:
    """Mean next-token cross-entropy over the ASSISTANT tokens, one sequence and one token at a time."""
    total, count = torch.zeros(()), 0
    for t in demonstrations:
        ids = t.prompt_ids + t.response_ids
        logits = model(torch.tensor([ids])).logits[0]
        for j, span in enumerate(t.spans):
            if span == ASSISTANT:
                position = len(t.prompt_ids) + j
                total = total - torch.log_softmax(logits[position - 1], -1)[ids[position]]
                count += 1
    return total / count


@pytest.mark.parametrize("micro_batch_size", [1, 3, 8])
def test_the_loss_and_its_gradient_equal_a_serial_per_token_loop(tiny_tokenizer, tiny_agent_dir, demonstrations,
                                                                 micro_batch_size):
    mixed = demonstrations[:1] + replay(task_with_other_lengths(), tiny_tokenizer, range(2), progress=False)
    batch = trajectories_to_batch(mixed, pad_token_id=tiny_tokenizer.pad_token_id)
    assert len({len(t.response_ids) for t in mixed}) > 1 and len({len(t.prompt_ids) for t in mixed}) > 1  # padding
    model = AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32)
    reference = serial_reference(model, mixed)
    reference.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    loss = step_loss(PolicyModel(model), batch, torch.arange(len(mixed)), micro_batch_size)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5) and reference.item() > 0.1
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, expected[name], atol=1e-5, rtol=1e-4), name  # float32 rounding


def task_with_other_lengths():
    class Other(Quadruple):  # a longer prompt and a one-turn demonstration: rows of other lengths
        system = "You are a careful assistant who checks every number twice."

        def demonstrate(self, episode, rng):
            n = episode.info["row"]["n"]
            return [{"role": "assistant", "content": "", "tool_calls": [{"name": "negate", "arguments": {"number": n}}]},
                    {"role": "tool", "content": str(-n)},
                    {"role": "assistant", "content": f"The answer is {4 * n}."}]

    return Other()


def test_row_order_visits_every_demonstration_each_pass():
    order = row_order(5, steps=4, batch_size=3, seed=0)
    assert order.shape == (4, 3)
    flat = order.flatten().tolist()
    assert sorted(flat[:5]) == list(range(5)) and sorted(flat[5:10]) == list(range(5))
    assert torch.equal(order, row_order(5, steps=4, batch_size=3, seed=0))


def test_has_demonstrations():
    assert has_demonstrations(Quadruple()) and has_demonstrations(get_task("arithmetic"))
    assert not has_demonstrations(Bare())

    class Plain:  # not a Task subclass: wrapped by as_task, its hook kept
        name = "plain"

        def make_episode(self, index, seed=0):
            return get_task("arithmetic").make_episode(index, seed)

        def reward(self, episode, messages, tool_calls):
            return 0.0

        def demonstrate(self, episode, rng):
            return None

    assert has_demonstrations(Plain()) and as_task(Plain()).demonstrate(None, None) is None
    assert Task.demonstrate(Quadruple(), None, None) is None


class Bare(Task):
    """The arithmetic task without its demonstrations."""

    name = "bare"

    def make_episode(self, index, seed=0):
        return get_task("arithmetic").make_episode(index, seed)

    def reward(self, episode, messages, tool_calls):
        return 0.0


def bad(demonstrate):
    """Quadruple with another demonstrate hook."""
    return type("Bad", (Quadruple,), {"demonstrate": lambda self, episode, rng: demonstrate(episode.info["row"]["n"])})()


@pytest.mark.parametrize("demonstrate, message", [
    (lambda n: [{"role": "assistant", "content": f"The answer is {n}."}],
     r"4 of 4 demonstrations cannot be trained on; the first, episode 0: does not succeed \(reward 0; final answer 'The answer is \d+\.'\)"),
    (lambda n: [{"role": "assistant", "content": "", "tool_calls": [{"name": "triple", "arguments": {"number": n}}]},
                {"role": "assistant", "content": f"The answer is {4 * n}."}],
     r"episode 0: its tool call triple\(\{'number': \d+\}\) fails: Error: unknown tool 'triple'"),
    (lambda n: [{"role": "assistant", "content": "", "tool_calls": [{"name": "double", "arguments": {"number": n}}]},
                {"role": "tool", "content": "12345"}, {"role": "assistant", "content": f"The answer is {4 * n}."}],
     r"episode 0: message 1 replays as .*'content': '\d+'\}, not as demonstrated .*'content': '12345'\}"),
    (lambda n: [{"role": "user", "content": "hi"}], r"episode 0: the demonstration message 0: expected an assistant or tool"),
    (lambda n: [{"role": "assistant", "content": "", "tool_calls": [{"name": "double", "arguments": {"number": n}}]}],
     r"episode 0: the demonstration must end with a final answer"),
    (lambda n: [{"role": "assistant", "content": "4"}, {"role": "assistant", "content": "4"}],
     r"episode 0: the demonstration message 1: follows a final answer"),
    (lambda n: [{"role": "assistant", "content": "", "tool_calls": [{"name": "double", "arguments": "not json"}]},
                {"role": "assistant", "content": "x"}], r"episode 0: the demonstration message 0: a tool call must be"),
    (lambda n: "The answer is 4.", r"episode 0: the demonstration must be a non-empty list of messages, got str"),
    (lambda n: 1 / 0, r"episode 0: demonstrate raised ZeroDivisionError: division by zero"),
    (lambda n: None, r"task 'Bad' gave no demonstration for its episodes 0..3"),
])
def test_bad_demonstrations_are_refused_naming_the_episode(tiny_tokenizer, demonstrate, message):
    with pytest.raises(DemonstrationError, match=message):
        replay(bad(demonstrate), tiny_tokenizer, range(4), progress=False)


def test_a_task_without_demonstrations_is_refused(tiny_tokenizer):
    with pytest.raises(DemonstrationError, match="^task 'bare' has no demonstrations: give it a demonstrate"):
        replay(Bare(), tiny_tokenizer, range(2), progress=False)


def test_whole_chats_and_given_tool_results_are_taken(tiny_tokenizer, demonstrations):
    chats = {t.info["index"]: t.messages for t in demonstrations}
    again = replay(_from_chats(chats), tiny_tokenizer, range(4), seed=3, progress=False)
    assert [t.response_ids for t in again] == [t.response_ids for t in demonstrations]


def test_a_dataset_with_a_demonstration_column_replays_as_the_task_that_demonstrates(tiny_tokenizer, demonstrations):
    from agent_loop import DatasetTask

    episodes = [Quadruple().make_episode(t.info["index"], seed=3) for t in demonstrations]
    rows = [{"prompt": e.messages, "answer": e.answer,
             "demonstration": t.messages[len(e.messages):]} for e, t in zip(episodes, demonstrations)]
    rows.append({"prompt": "What is four times 5?", "answer": "20"})  # a row without one is not demonstrated
    task = DatasetTask(rows, lambda completion, answer: float(completion == f"The answer is {answer}."),
                       tools=[double, negate])
    assert has_demonstrations(task) and not has_demonstrations(DatasetTask(rows[-1:], "exact"))
    with pytest.warns(UserWarning, match="demonstrate gave none for 1 of 5 episodes; training on the other 4"):
        again = replay(task, tiny_tokenizer, range(5), progress=False)
    assert [t.response_ids for t in again] == [t.response_ids for t in demonstrations]
    assert [t.prompt_ids for t in again] == [t.prompt_ids for t in demonstrations]


def _from_chats(chats):
    class FromChats(Quadruple):
        name = "Quadruple"  # the same episodes

        def demonstrate(self, episode, rng):  # a Trajectory's messages: the prompt, calls, tool results, answer
            return next(m for m in chats.values() if m[0] == episode.messages[0])

    return FromChats()


def test_a_short_warm_start_lowers_the_loss_and_saves_a_model_the_loop_loads(tmp_path, tiny_agent_dir):
    config = WarmstartConfig(model=str(tiny_agent_dir), episodes=8, steps=4, batch_size=4, micro_batch_size=2, lr=1e-3,
                             warmup_steps=0, output_dir=str(tmp_path / "run"), progress=False, threads=1,
                             check_episodes=0)
    result = warm_start(config, Quadruple())
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4] and lines[-1]["loss"] < lines[0]["loss"]
    assert lines[0]["lr"] == pytest.approx(1e-3) and lines[1]["lr"] < lines[0]["lr"]
    assert [m["lr"] for m in lines] == [lr_at(step, config) for step in range(4)]  # agent_loop.training.optimization's cosine
    assert len((tmp_path / "run" / "demonstrations.jsonl").read_text().splitlines()) == 8
    assert check_model_dir(result.model_dir).architecture == "LlamaForCausalLM"
    assert not checkpoint.problems(result.model_dir) and not checkpoint.damaged(result.model_dir)  # its manifest
    assert json.loads((result.model_dir / checkpoint.MANIFEST).read_text())["step"] == 4
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["demonstrations.jsonl", "metrics.jsonl", "model"]
    assert result.longest["turns"] == 3
    assert result.longest["response_tokens"] == max(len(t.response_ids) for t in result.demonstrations)
    with pytest.raises(FileExistsError, match=r"holds an earlier warm start \(demonstrations.jsonl, metrics.jsonl, model\)"):
        warm_start(config, Quadruple())
    trained = AutoModelForCausalLM.from_pretrained(result.model_dir, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32)
    assert serial_reference(trained, result.demonstrations) < serial_reference(base, result.demonstrations)


def test_the_model_folder_is_replaced_whole_or_not_at_all(tmp_path, tiny_tokenizer, tiny_agent_dir):
    """save_model over an earlier model folder: a save that fails part-way leaves the earlier folder as it was
    (never emptied first) and nothing beside it; one that succeeds replaces it, with its manifest."""
    from agent_loop.training.model_folder import save_model

    model = AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32)
    folder = save_model(model, tiny_tokenizer, tmp_path / "model", step=1)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    class Failing:  # writes part of a folder, then the disk is full
        def save_pretrained(self, target):
            (Path(target) / "config.json").write_text("{}")
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        save_model(Failing(), tiny_tokenizer, folder, step=2)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before and [p.name for p in tmp_path.iterdir()] == ["model"]
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    save_model(model, tiny_tokenizer, folder, step=2)
    assert json.loads((folder / checkpoint.MANIFEST).read_text())["step"] == 2 and not checkpoint.problems(folder)
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_the_default_steps_scale_with_the_demonstrations():
    from agent_loop.recipes.warmstart import planned_steps

    assert planned_steps(WarmstartConfig(), 256) == 600  # the shipped default: 37.5 passes of 256 at batch 16
    assert planned_steps(WarmstartConfig(), 32) == 75 and planned_steps(WarmstartConfig(epochs=2), 33) == 5
    assert planned_steps(WarmstartConfig(steps=7), 256) == 7  # given: kept
    # issue 49 item 2: a --model took the tiny agent's 37.5 passes (600 steps x 16: hours for a real model on a CPU)
    assert planned_steps(WarmstartConfig(model="smollm2-135m"), 256) == 40  # 2.5 passes of 256 at batch 16
    assert planned_steps(WarmstartConfig(model="smollm2-135m"), 64) == 10
    assert planned_steps(WarmstartConfig(model="smollm2-135m", epochs=37.5), 256) == 600  # given: kept
    # and its learning rate: at 1e-5 SmolLM2-135M's held-out sampled success was 0.50, at 1e-4 1.00 (BENCHMARKS.md, issue 49)
    assert WarmstartConfig(model="smollm2-135m").learning_rate == 1e-4 and WarmstartConfig().learning_rate == 3e-3


def as_older_checkpoint(folder, *, warmup: int, steps: int) -> None:
    """Rewrite warm-start checkpoint ``folder`` as one from before agent_loop/training/optimization.py: its state also holds the
    transformers LR scheduler's state (and the optimizer's groups its ``initial_lr``), which a resume now ignores."""
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    import agent_loop.training.checkpoint as checkpoint

    state = checkpoint.load_state(folder)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=state["config"]["lr"])
    schedule = get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, steps, min_lr_rate=0.1)
    for _ in range(state["step"]):
        optimizer.step()
        schedule.step()
    for group in state["optimizer"]["param_groups"]:
        group["initial_lr"] = state["config"]["lr"]
    checkpoint.write_checkpoint(folder, step=state["step"], state={**state, "schedule": schedule.state_dict()},
                                save_model=lambda target: shutil.copytree(folder / "model", target))
    assert "schedule" in checkpoint.load_state(folder) and not checkpoint.problems(folder)


@pytest.mark.slow
def test_an_interrupted_warm_start_resumes_to_the_uninterrupted_weights(tmp_path, tiny_agent_dir, monkeypatch, capsys):
    """Stopped after step 3 of 4 (a checkpoint every 2 steps), then --resume: the same metrics and bit-equal weights
    as the run that was never stopped, from a checkpoint written as before agent_loop/training/optimization.py (with its
    scheduler state); the work and an ETA are printed before the steps."""
    import agent_loop.training.finetune as finetune

    def config(name: str, **more) -> WarmstartConfig:
        return WarmstartConfig(**{**dict(model=str(tiny_agent_dir), episodes=6, steps=4, batch_size=4,
                                         micro_batch_size=2, lr=1e-3, warmup_steps=1, save_every=2, progress=False,
                                         output_dir=str(tmp_path / name), threads=1, check_episodes=0), **more})

    whole = warm_start(config("whole"), Quadruple())
    printed = capsys.readouterr().out
    assert "warm start: 6 demonstrations of " in printed and "4 steps x 4 = 16 demonstrations (2.67 passes)" in printed
    assert "warm start: step 1 took " in printed and "ETA " in printed and "for the other 3 steps" in printed
    assert [p.name for p in (tmp_path / "whole" / "checkpoints").glob("step_*")] == ["step_000002"]  # the latest only

    calls, step = [0], finetune.optimizer_step

    def stop_in_step_4(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 4:
            raise KeyboardInterrupt  # Ctrl-C during step 4: the checkpoint of step 2 is the latest
        return step(*args, **kwargs)

    monkeypatch.setattr(finetune, "optimizer_step", stop_in_step_4)
    with pytest.raises(KeyboardInterrupt):
        warm_start(config("stopped"), Quadruple())
    monkeypatch.setattr(finetune, "optimizer_step", step)
    as_older_checkpoint(tmp_path / "stopped" / "checkpoints" / "step_000002", warmup=1, steps=4)
    with pytest.raises(FileExistsError):
        warm_start(config("stopped"), Quadruple())  # not without --resume
    with pytest.raises(checkpoint.CheckpointError, match="lr: 0.001 -> 0.002"):
        warm_start(config("stopped", resume=True, lr=2e-3), Quadruple())  # another run's settings: refused
    resumed = warm_start(config("stopped", resume=True), Quadruple())
    assert [m["loss"] for m in resumed.history] == [m["loss"] for m in whole.history]
    lines = [json.loads(line) for line in (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]  # step 3, logged before the stop, is logged once
    assert lines == [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    a = AutoModelForCausalLM.from_pretrained(whole.model_dir, dtype=torch.float32).state_dict()
    b = AutoModelForCausalLM.from_pretrained(resumed.model_dir, dtype=torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_progress_bar_shows_each_steps_loss(tiny_tokenizer, tiny_agent_dir, demonstrations, monkeypatch):
    """Issue 49 item 2: the bar showed the first step's loss until step 10 while metrics.jsonl fell. Every step's
    loss is shown, as the bar next moves (a bar that redraws on every move, into a buffer)."""
    import io

    import agent_loop.recipes.warmstart as warmstart
    import agent_loop.training.finetune as finetune

    shown = io.StringIO()

    class Bar(finetune.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs, file=shown, mininterval=0, miniters=1)

    monkeypatch.setattr(finetune, "tqdm", Bar)
    model = AutoModelForCausalLM.from_pretrained(tiny_agent_dir, dtype=torch.float32)
    batch = trajectories_to_batch(demonstrations, pad_token_id=tiny_tokenizer.pad_token_id)
    config = WarmstartConfig(steps=4, batch_size=2, lr=1e-2, warmup_steps=0, progress=True)
    history = warmstart.fine_tune_on_demonstrations(model, batch, config)
    losses = [f"loss={m['loss']:.3f}" for m in history]
    assert len(set(losses)) == 4, losses  # four different losses, each of which the bar showed
    assert all(loss in shown.getvalue() for loss in losses), (losses, shown.getvalue())


def test_the_warm_start_ends_with_a_sampled_check_on_held_out_questions(tmp_path, tiny_agent_dir):
    """Issue 49 item 2: a warm start that did not take (0/40 sampled afterwards) said nothing. It now plays
    --check-episodes held-out questions (train's evaluation stream, never the demonstrations'), sampled at T=1, by
    the model it saved, and the line names the sampling and the count; --check-episodes 0 skips it."""
    from agent_loop.recipes.train import EVAL_SEED_OFFSET
    from agent_loop.recipes.warmstart import CHECK_FILE
    from agent_loop.training.held_out import check_line

    config = WarmstartConfig(model=str(tiny_agent_dir), episodes=4, steps=1, batch_size=2, warmup_steps=0, seed=5,
                             output_dir=str(tmp_path / "run"), progress=False, threads=1, check_episodes=3)
    result = warm_start(config, Quadruple())
    check = result.check
    assert [(t.info["index"], t.info["seed"]) for t in check] == [(i, 5 + EVAL_SEED_OFFSET) for i in range(3)]
    assert {t.info["seed"] for t in result.demonstrations} == {5}  # the demonstrations: another stream
    assert all(t.info["options"]["temperature"] == 1.0 and t.logprobs for t in check)  # sampled by the model
    written = (tmp_path / "run" / CHECK_FILE).read_text().splitlines()  # in the order they ended
    assert sorted(json.loads(line)["info"]["index"] for line in written) == [0, 1, 2]
    successes, calls = sum(bool(t.info["success"]) for t in check), sum(len(t.tool_calls) for t in check)
    errors = sum(bool(c.error_kind) for t in check for c in t.tool_calls)
    line = check_line(check)
    assert line.startswith(f"held-out check (sampled at T=1, 3 episodes): success {successes / 3:.3f}; "
                           f"{calls / 3:.2f} tool calls and {errors / 3:.2f} tool errors an episode"), line
    assert ("did not take" in line) == (successes < 1.5)
    skipped = warm_start(dataclasses.replace(config, output_dir=str(tmp_path / "skip"), check_episodes=0), Quadruple())
    assert skipped.check == [] and not (tmp_path / "skip" / CHECK_FILE).exists()
