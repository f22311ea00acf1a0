"""One RL step by hand: the whole algorithm of `agent-loop train` in one file, on the built-in tiny agent.

    rollouts -> batch -> old logprobs -> rewards and advantages -> PPO-clip loss -> AdamW step

Public API only: `agent_loop` plays the episodes, `agent_loop.runners.batch` turns them into tensors,
`advantages` computes the carry-through returns and the loss. The step below is the one that

    agent-loop train --model tiny-mid --steps 1 --prompts-per-step 8 --concurrency 8 --mini-batches 1 \
        --micro-batch-size 8 --lr 1e-5 --warmup-steps 0

takes: after it, the weights are the recipe's to 1e-6 (tests/recipes/test_rl_step_by_hand.py checks it).
The recipe adds what a long run needs (groups of samples, mini-batches, KL and entropy terms, checkpoints,
asynchronous rollouts, several GPUs); the algorithm is this.

Run: .venv/bin/python examples/rl_step_by_hand.py
"""

import copy

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from advantages import get_estimator, ppo_clip_policy_loss
from agent_loop import TransformersBackend, rollout
from agent_loop.model_folders import model_path
from agent_loop.runners.batch import trajectories_to_batch

MODEL = "tiny-mid"  # the tiny agent's middling warm start: RL can still improve it
TASK = "arithmetic"  # two turns: call the calculator, then answer
EPISODES = 8  # one sample of each of 8 questions (train's --prompts-per-step 8 --group-size 1)
SEED = 0  # the questions and the sampling
LR = 1e-5  # AdamW's first step moves each weight by about LR, whatever the size of its gradient
CLIP_RATIO = 0.2  # PPO's trust region: the ratio new/old probability is clipped to [0.8, 1.2]
MAX_GRAD_NORM = 1.0
GAMMA = 1.0  # returns are not discounted
# the episode loop's limits and sampling, as train sets them (agent_loop.LoopConfig fields)
LOOP = dict(max_turns=3, max_tokens=48, max_response_tokens=256, temperature=1.0)


def response_logprobs(policy, batch) -> torch.Tensor:
    """The log-probability ``(b, t)`` of each response token under ``policy``: one forward over prompt + response
    (prompts left-padded, responses right-padded), the logits at position i predicting token i + 1."""
    logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids).logits
    logits = logits[:, -batch.responses.shape[1] - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)


def rl_step(policy, tokenizer, optimizer, seed: int = SEED) -> dict[str, float]:
    """One RL step on ``policy`` (trained in place); returns what it measured."""
    # 1. Rollouts: the sampler holds a copy of the current weights and plays every episode to its end
    #    (model turns, tool calls, tool results), recording each token and whether the model wrote it.
    sampler = TransformersBackend(copy.deepcopy(policy), max_batch_size=EPISODES, pad_token_id=tokenizer.pad_token_id)
    trajectories = rollout(TASK, model=MODEL, episodes=EPISODES, backend=sampler, seed=seed,
                           concurrency=EPISODES, progress=False, **LOOP)

    # 2. Batch: right-padded (b, t) tensors. spans say who wrote each response token (ASSISTANT: the model,
    #    OBSERVATION: a tool); response_mask is 1 on ASSISTANT tokens, the only ones trained; the episode's
    #    reward sits on its last ASSISTANT token (token_level_rewards).
    batch = trajectories_to_batch(trajectories, pad_token_id=tokenizer.pad_token_id)
    mask = batch.response_mask

    # 3. Old logprobs: the trainer's own view of the sampled tokens, before the update.
    with torch.no_grad():
        old_logprobs = response_logprobs(policy, batch)

    # 4. Advantages: REINFORCE++ with carry-through returns: the return flows back through the tool's
    #    tokens to the earlier turns that called it, then is whitened over the batch's ASSISTANT tokens.
    advantages, _ = get_estimator("reinforce_plus_plus")(batch.token_level_rewards, mask, gamma=GAMMA,
                                                           spans=batch.spans)

    # 5. Loss: PPO-clip, the mean over every ASSISTANT token of the batch. Then clip the gradient and step.
    loss, stats = ppo_clip_policy_loss(old_logprobs, response_logprobs(policy, batch), advantages, mask,
                                       clip_ratio=CLIP_RATIO)
    optimizer.zero_grad()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    return {"success": sum(t.success for t in trajectories) / EPISODES, "loss": loss.item(),
            "grad_norm": grad_norm.item(), "clip_frac": stats["clipfrac"].item()}


def main():
    """Load the policy, take one step, print what it measured; returns the policy and the metrics."""
    path = model_path(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=LR, weight_decay=0.0)
    metrics = rl_step(policy, tokenizer, optimizer)
    print(" | ".join(f"{name} {value:.4g}" for name, value in metrics.items()))
    return policy, metrics


if __name__ == "__main__":
    main()
