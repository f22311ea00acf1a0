"""The trainer on the real tiny agent (its middling warm start), real rollouts through the agent loop.

Checks: a step gives a finite loss, changes every parameter and pushes the weights to the rollout
backend; the trainer's logprobs equal the sampler's; the PPO loss equals a plain per-row, per-token
reference; gradient accumulation equals one pass; only ASSISTANT tokens get gradient (a probe on the
logits and on the value head's output); the return variants of the ablation are wired as named;
resuming from a checkpoint reproduces the next step; the CLI writes metrics and a checkpoint.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from agent_loop import TrainConfig, Trainer
from agent_loop.cli.train import main as train_main
from agent_loop.tasks.grouping import GroupedTask
from agent_loop.tasks.registry import get_task
from agent_loop.training.checkpoint import step_folder
from masking import SpanKind
from tests.helpers.reference_losses import ppo_token_loss
from tests.helpers.trainer_config import batch_of, random_advantages, small_config

ASSISTANT, OBSERVATION, PAD = SpanKind.ASSISTANT, SpanKind.OBSERVATION, SpanKind.PAD


def scored_batch(trainer: Trainer, step: int = 0) -> dict[str, torch.Tensor]:
    batch = batch_of(trainer, trainer.rollouts.play_groups(step * trainer.config.rollout.prompts_per_step))
    trainer.ppo.score(batch)
    return batch


def reference_ppo_loss(model, trajectories, old_logprobs, advantages, clip_ratio: float) -> float:
    """Serial reference: each trajectory unpadded through the model on its own, then a loop over its
    ASSISTANT tokens; the token-mean of the dual-clip PPO term (``reference_losses.ppo_token_loss``)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row, trajectory in enumerate(trajectories):
            ids = trajectory.prompt_ids + trajectory.response_ids
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
            p = len(trajectory.prompt_ids)
            for j, token in enumerate(trajectory.response_ids):
                if trajectory.spans[j] != ASSISTANT:
                    continue
                ratio = math.exp(float(logprobs[p + j - 1, token]) - float(old_logprobs[row, j]))
                a = float(advantages[row, j])
                total += ppo_token_loss(ratio, a, clip_ratio, clip_ratio)
                count += 1
    return total / count


@pytest.mark.slow
def test_step_is_finite_changes_every_parameter_and_pushes_weights(tiny_mid, tmp_path):
    trainer = Trainer(small_config(tiny_mid, tmp_path, entropy_coef=0.01))  # a signal even if every reward is 0
    before = {name: p.detach().clone() for name, p in trainer.policy.named_parameters()}
    metrics = trainer.train_step()

    assert trainer.step == 1
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["loss"] != 0.0 and metrics["grad_norm"] > 0 and metrics["entropy"] > 0
    unchanged = [name for name, p in trainer.policy.named_parameters() if torch.equal(p, before[name])]
    assert unchanged == []
    rollout_weights = trainer.backend.model.state_dict()
    assert all(torch.equal(rollout_weights[name], p) for name, p in trainer.policy.state_dict().items())
    # the sampler (incremental decoding, left-padded batches) and the trainer (one padded forward) agree
    assert metrics["logprob_mismatch/mean_abs"] < 1e-4
    assert metrics["logprob_mismatch/max_abs"] < 1e-3
    assert 0.0 <= metrics["success"] <= 1.0 and metrics["turns"] >= 1.0


@pytest.mark.slow
def test_ppo_loss_equals_serial_reference_after_an_update(tiny_mid, tmp_path):
    trainer = Trainer(small_config(tiny_mid, tmp_path, lr=1e-2))
    trajectories = trainer.rollouts.play_groups(0)
    batch = batch_of(trainer, trajectories)
    trainer.ppo.score(batch)
    random_advantages(batch)
    trainer.ppo.update(batch, step=0)  # a large step, so that ratios move away from 1 and some get clipped
    loss, stats = trainer.ppo.micro_batch_loss(batch)

    expected = reference_ppo_loss(trainer.policy, trajectories, batch["old_logprobs"], batch["advantages"],
                                  trainer.config.update.clip_ratio)
    assert float(loss) == pytest.approx(expected, abs=1e-5)
    assert float(stats["clip_frac"]) > 0  # the clipped branch was exercised


@pytest.mark.slow
def test_gradient_accumulation_equals_one_pass(tiny_mid, tmp_path):
    trainer = Trainer(small_config(tiny_mid, tmp_path, mini_batches=1, max_grad_norm=1e9))
    trainer.config.update.lr = 0.0  # the weights stay put between the passes (an option refuses 0: it is set after the checks)
    batch = scored_batch(trainer)
    random_advantages(batch)
    gradients = []
    for micro_batch_size in (1, 3, trainer.config.episodes_per_step):
        trainer.config.update.micro_batch_size = micro_batch_size
        trainer.ppo.update(batch, step=0)
        gradients.append([p.grad.clone() for p in trainer.policy.parameters()])
    for other in gradients[1:]:
        for one_pass, accumulated in zip(gradients[-1], other):
            torch.testing.assert_close(accumulated, one_pass, atol=1e-7, rtol=1e-4)


@pytest.mark.slow
def test_a_batch_without_signal_leaves_the_weights_alone(tiny_mid, tmp_path):
    """All-zero advantages give a zero gradient; AdamW would still move the weights along its momentum
    from earlier steps, so the trainer skips that step."""
    trainer = Trainer(small_config(tiny_mid, tmp_path, lr=1e-2))
    batch = scored_batch(trainer)
    random_advantages(batch)
    assert trainer.ppo.update(batch, step=0)["skipped_updates"] == 0.0
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    batch["advantages"] = torch.zeros_like(batch["advantages"])
    metrics = trainer.ppo.update(batch, step=1)
    assert metrics["skipped_updates"] == 1.0 and metrics["grad_norm"] == 0.0
    assert all(torch.equal(p, q) for p, q in zip(trainer.policy.parameters(), before))


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "grpo", "gae"])
def test_only_assistant_tokens_receive_gradient(tiny_mid, tmp_path, estimator):
    """Gradient probe: d loss / d logits (and d loss / d values for GAE) is exactly 0 at every
    OBSERVATION and PAD position, and nonzero at every ASSISTANT position (the entropy bonus and
    the KL penalty make every ASSISTANT token count)."""
    trainer = Trainer(small_config(tiny_mid, tmp_path, estimator=estimator, kl_coef=0.1, entropy_coef=0.01))
    if trainer.value_head is not None:  # a critic that starts at 0 would have nothing to learn from zero rewards
        torch.nn.init.normal_(trainer.value_head.linear.weight, generator=torch.Generator().manual_seed(0))
    batch = scored_batch(trainer)
    spans = batch["spans"]
    assert (spans == ASSISTANT).any() and (spans == OBSERVATION).any() and (spans == PAD).any()

    outputs = {}
    # the output head in one piece, and the forward's logits kept: backward recomputes each checkpointed piece
    # (agent_loop/training/policy.py chunked_head), which calls the hook again on a copy that gets no gradient
    getattr(trainer.model, "module", trainer.model).logits_chunk = spans.numel()

    def keep(name):
        def hook(module, inputs, output):
            if name not in outputs:
                output.retain_grad()
                outputs[name] = output
        return hook

    handles = [trainer.policy.get_output_embeddings().register_forward_hook(keep("logits"))]
    if trainer.value_head is not None:
        handles.append(trainer.value_head.linear.register_forward_hook(keep("values")))
    loss, _ = trainer.ppo.micro_batch_loss(batch)
    loss.backward()
    for handle in handles:
        handle.remove()

    assert set(outputs) == ({"logits", "values"} if estimator == "gae" else {"logits"})
    for name, output in outputs.items():
        grad = output.grad.abs()  # logits: (b * t, v), the head's rows are the response positions in order
        per_token = (grad.sum(-1) if grad.dim() == 2 else grad.flatten(2).sum(-1)).reshape(spans.shape)  # (b, t)
        assert per_token.shape == spans.shape
        assert torch.all(per_token[spans != ASSISTANT] == 0), f"{name}: gradient leaked to non-ASSISTANT tokens"
        assert torch.all(per_token[spans == ASSISTANT] > 0), f"{name}: an ASSISTANT token got no gradient"


# the ablation's return variants are ordinary registry entries
ESTIMATOR_OF = {"carry_through": "reinforce_plus_plus",
                "reset_at_observation": "reinforce_plus_plus_reset_at_observation",
                "ignore_mask": "reinforce_plus_plus_ignore_mask"}


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_return_variants_are_wired_as_named(tiny_mid, tmp_path, gamma):
    """Every episode rewarded 1.0 on its last ASSISTANT token: carry-through gives the first turn's
    tokens the discounted outcome, the pre-fix reset gives them 0 (when a later turn exists), and
    ignoring the mask gives them less than carry-through (observation tokens cost discount steps;
    equal at gamma 1)."""
    trainers = {v: Trainer(small_config(tiny_mid, tmp_path / v, estimator=ESTIMATOR_OF[v], gamma=gamma))
                for v in ESTIMATOR_OF}
    trajectories = trainers["carry_through"].rollouts.play_groups(0)
    for t in trajectories:
        t.reward = 1.0
    returns = {}
    for variant, trainer in trainers.items():
        batch = batch_of(trainer, copy.deepcopy(trajectories))
        trainer.ppo.score(batch)
        returns[variant] = batch["returns"]
    spans, turns = batch["spans"], batch["turn_ids"]
    first_turn = (spans == ASSISTANT) & (turns == 0)
    last_turn = (spans == ASSISTANT) & (turns == turns.max(-1, keepdim=True).values)
    two_turns = ((spans == ASSISTANT) & (turns > 0)).any(-1, keepdim=True)
    assert two_turns.any()

    # serial reference for carry-through: gamma ** (ASSISTANT tokens after this one)
    after = (spans == ASSISTANT).flip(-1).cumsum(-1).flip(-1) - 1
    expected = torch.where(spans == ASSISTANT, torch.full(spans.shape, gamma) ** after, 0.0)
    torch.testing.assert_close(returns["carry_through"], expected)
    reset = returns["reset_at_observation"]
    assert torch.all(reset[first_turn & two_turns] == 0)
    torch.testing.assert_close(reset[last_turn], expected[last_turn])
    ignore = returns["ignore_mask"][first_turn & two_turns]
    if gamma == 1.0:
        assert torch.equal(ignore, expected[first_turn & two_turns])
    else:
        assert torch.all(ignore < expected[first_turn & two_turns])


@pytest.mark.slow
def test_resume_reproduces_the_next_step(tiny_mid, tmp_path):
    # KL and entropy terms: the update moves the weights whatever the success rate
    config = small_config(tiny_mid, tmp_path, steps=2, save_every=1, kl_coef=0.05, entropy_coef=0.01)
    straight = Trainer(config)
    history = straight.train()

    resumed = Trainer(config.replace(resume=str(step_folder(straight.output_dir, 1)),
                                     output_dir=str(tmp_path / "resumed")))
    assert resumed.step == 1
    metrics = resumed.train_step()

    for name in ("success", "reward", "assistant_tokens", "observation_tokens"):
        assert metrics[name] == history[1][name], name
    assert metrics["loss/first"] == pytest.approx(history[1]["loss/first"], abs=1e-6)
    assert metrics["loss"] == pytest.approx(history[1]["loss"], abs=1e-6)
    for (name, a), b in zip(straight.policy.named_parameters(), resumed.policy.parameters()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0, msg=name)


# the settings a checkpoint written before the options were declared once (issue 27) did not have
NEWER_SETTINGS = ("top_p", "top_k", "max_observation_tokens", "max_parallel_tool_calls", "tool_timeout_s",
                  "backend_retries", "retry_backoff_s", "history_mode", "on_template_mismatch", "prompts", "reward",
                  "reward_weights", "tools", "system")


@pytest.mark.slow
def test_a_checkpoint_from_before_the_one_declaration_still_resumes(tiny_mid, tmp_path):
    """Its saved settings lack the loop and task options and hold ``lr: None``: they resume, and a learning
    rate that differs from the one the old run used is still refused."""
    from agent_loop.training.checkpoint import STATE_FILE, CheckpointError

    config = small_config(tiny_mid, tmp_path, steps=1, save_every=1)
    first = Trainer(config)
    first.train()
    path = step_folder(first.output_dir, 1) / STATE_FILE
    state = torch.load(path, weights_only=False)
    assert state["config"]["lr"] == config.learning_rate  # checkpoints now record the resolved value
    state["config"] = {**{k: v for k, v in state["config"].items() if k not in NEWER_SETTINGS}, "lr": None}
    torch.save(state, path)
    (step_folder(first.output_dir, 1) / "checkpoint.json").unlink()  # as before manifests: the essentials are checked
    resumed = Trainer(config.replace(steps=2, resume=str(tmp_path / "run")))
    assert resumed.step == 1 and math.isfinite(resumed.train_step()["loss"])
    with pytest.raises(CheckpointError, match=r"lr: 2.5e-05 -> 0.001"):
        Trainer(config.replace(steps=2, lr=1e-3, resume=str(tmp_path / "run")))


@pytest.mark.slow
def test_cli_writes_metrics_and_checkpoint(tiny_mid, tmp_path, capsys, monkeypatch):
    out = tmp_path / "cli"
    monkeypatch.setenv("WANDB_MODE", "offline")  # a real wandb run, written locally
    status = train_main(["--model", tiny_mid, "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
                         "--mini-batches", "1", "--output-dir", str(out), "--no-progress", "--wandb-project", "test"])
    assert status == 0
    (line,) = (out / "metrics.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["step"] == 1
    for key in ("reward", "success", "turns", "assistant_tokens", "finish_frac/stop", "tool_errors_count/malformed_json", "errors/reward", "errors/tool",
                "errors/template", "lr",
                "ppo_kl", "clip_frac", "entropy", "grad_norm", "advantages/mean", "logprob_mismatch/mean_abs"):
        assert key in record, key
    assert "template_mismatch" not in record and "clipfrac" not in record  # each metric under one name
    checkpoint = out / "checkpoints" / "step_000001"
    assert (checkpoint / "model" / "config.json").exists() and (checkpoint / "trainer_state.pt").exists()
    assert "step    1 | success" in capsys.readouterr().out
    # the same numbers in TensorBoard's event file (on by default) and in wandb's offline run file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for key in ("success", "loss", "grad_norm"):
        (scalar,) = events.Scalars(key)
        assert (scalar.step, scalar.value) == (1, pytest.approx(record[key], rel=1e-6)), key
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    logged = run_file.read_bytes()
    for key in ("success", "loss", "grad_norm"):
        assert key.encode() in logged and json.dumps(record[key]).encode() in logged, key


def test_cli_and_trainer_reject_bad_settings(tmp_path, capsys):
    assert train_main(["--prompts-per-step", "3", "--group-size", "1", "--mini-batches", "2"]) == 2
    assert "--mini-batches 2: must divide" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        Trainer(TrainConfig.from_flat(estimator="nope", output_dir=str(tmp_path)))
    assert train_main(["--estimator", "grpo", "--group-size", "1"]) == 2
    assert "--estimator grpo: compares samples of the same question; needs --group-size 2" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kl_kind"):
        Trainer(TrainConfig.from_flat(kl_kind="k4", output_dir=str(tmp_path)))


def test_grouped_task_gives_each_group_one_question_and_each_sample_its_own_index():
    task = GroupedTask(get_task("arithmetic"), group_size=3, question_seed=7)
    episodes = [task.make_episode(i) for i in range(6)]
    plain = get_task("arithmetic")
    assert [e.info["group"] for e in episodes] == [0, 0, 0, 1, 1, 1]
    assert [e.info["index"] for e in episodes] == list(range(6))
    for e in episodes:
        assert e.messages == plain.make_episode(e.info["group"], 7).messages
    assert episodes[0].messages != episodes[3].messages
    assert task.name == "arithmetic"


@pytest.mark.slow
def test_bf16_step_keeps_fp32_master_weights_and_pushes_bf16_to_the_sampler(tiny_mid, tmp_path):
    trainer = Trainer(small_config(tiny_mid, tmp_path, dtype="bf16", device="cpu", entropy_coef=0.01))
    before = {name: p.detach().clone() for name, p in trainer.policy.named_parameters()}
    metrics = trainer.train_step()
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert all(p.dtype == torch.float32 for p in trainer.policy.parameters())  # master weights and AdamW in fp32
    assert any(not torch.equal(p, before[name]) for name, p in trainer.policy.named_parameters())
    rollout_weights = trainer.backend.model.state_dict()
    for name, p in trainer.policy.state_dict().items():
        assert rollout_weights[name].dtype == torch.bfloat16
        assert torch.equal(rollout_weights[name], p.to(torch.bfloat16)), name
    # bf16 forward passes: sampler and trainer agree to bf16 precision, not fp32's
    assert metrics["logprob_mismatch/mean_abs"] < 0.1
    assert "time/weight_sync_s" in metrics


def test_device_and_dtype_are_checked(tmp_path):
    assert train_main(["--dtype", "fp16"]) == 2  # usage errors: one line, exit 2 (tests/cli/test_cli.py)
    assert train_main(["--device", "tpu"]) == 2
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            Trainer(TrainConfig.from_flat(device="cuda", output_dir=str(tmp_path)))
        assert not (tmp_path / "metrics.jsonl").exists()  # refused before touching the output folder


def test_closing_line_compares_means_of_the_first_and_last_steps_and_reports_the_evaluation():
    from agent_loop.training.metrics import progress_summary

    history = [{"success": s} for s in (0.2, 0.4, 0.3, 0.1, 0.5, 0.5, 0.6, 0.2, 0.4, 0.7, 0.3)]
    figures = {"sampling": "sampled at T=1", "episodes_per_step": 16}
    assert progress_summary(history, **figures) == (
        "success (sampled at T=1, 16 episodes a step) 0.300 (mean of the first 5 steps) -> "
        "0.440 (mean of the last 5 steps)")
    assert progress_summary(history[:3], **figures) == (
        "success (sampled at T=1, 16 episodes a step) 0.200 (mean of the first step) -> 0.300 (mean of the last step)")
    # the trial's run: sampled success fell while the greedy held-out success rose; the line says both
    line = progress_summary(history, **figures, evaluations=[(0, 0.475), (10, 0.5), (20, 0.55)], eval_episodes=40)
    assert line.endswith("; held-out success (greedy, 40 episodes) 0.475 (step 0) -> 0.550 (step 20)")
    assert progress_summary(history, **figures, evaluations=[(20, 0.55)], eval_episodes=1).endswith(
        "; held-out success (greedy, 1 episode) 0.550 at step 20")


def test_the_default_learning_rate_scales_with_the_batch_and_unstable_ones_are_flagged():
    assert TrainConfig().learning_rate == 2e-4  # 64 prompts, 2 mini-batches: 32 episodes per AdamW step
    assert TrainConfig.from_flat(prompts_per_step=16).learning_rate == pytest.approx(5e-5)  # 8 per AdamW step
    assert TrainConfig.from_flat(prompts_per_step=256).learning_rate == 2e-4  # never above the measured one
    for prompts in (4, 16, 64, 256):  # the default is never flagged
        assert TrainConfig.from_flat(prompts_per_step=prompts).unstable_learning_rate() is None
    warning = TrainConfig.from_flat(prompts_per_step=16, lr=2e-4).unstable_learning_rate()
    assert "8 episodes per AdamW step" in warning and "lr <= 0.0001" in warning
    assert TrainConfig.from_flat(prompts_per_step=16, lr=5e-5).unstable_learning_rate() is None


def test_checkpoint_module_takes_and_returns_plain_data():
    """Issue 37 item 1: agent_loop/training/checkpoint.py reads no Trainer attribute; the Trainer gives and takes its state
    as a dict (state_dict / load_state_dict), and write_checkpoint writes any such dict with a model folder."""
    import inspect

    import agent_loop.training.checkpoint as checkpoint

    functions = [f for _, f in inspect.getmembers(checkpoint, inspect.isfunction) if f.__module__ == checkpoint.__name__]
    assert functions and all("trainer" not in inspect.signature(f).parameters for f in functions)
    assert "trainer." not in inspect.getsource(checkpoint).replace("trainer.checkpoint", "")
    assert callable(Trainer.state_dict) and callable(Trainer.load_state_dict)


def test_write_checkpoint_writes_a_plain_state_that_resolves_and_loads(tmp_path):
    from agent_loop.training import checkpoint

    state = {"step": 3, "optimizer": {"state": {}, "param_groups": []}, "initial_model": "m", "config": {"lr": 1.0},
             "rng": checkpoint.rng_state(), "value_head": None}
    path = checkpoint.write_checkpoint(tmp_path / "checkpoints" / "step_000003", step=3, state=state,
                                       save_model=lambda folder: (folder.mkdir(parents=True), (folder / "config.json").write_text("{}")))
    assert checkpoint.resolve_checkpoint(tmp_path) == path and (tmp_path / "checkpoints" / "latest").read_text() == "step_000003\n"
    loaded = checkpoint.load_state(path)
    assert loaded["step"] == 3 and loaded["config"] == {"lr": 1.0} and torch.equal(loaded["rng"]["torch"], state["rng"]["torch"])
