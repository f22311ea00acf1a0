"""TRL's ``GRPOTrainer`` with tools, trained on agent-loop's spans and carry-through advantages.

    python examples/trl_grpo_tools.py              # in an environment with TRL (docs/trl.md)

``SpanGRPOTrainer`` is the recipe: a ``trl.GRPOTrainer`` subclass that keeps TRL's generation, tool
loop, reward functions and loss, and replaces only the advantages: it takes the per-sequence
rewards where TRL computes them (``_calculate_rewards``), builds spans from TRL's own masks
(tool results are OBSERVATION tokens) and writes a registered estimator's ``(b, t)`` advantages
(default REINFORCE++, carry-through returns) into TRL's loss input ``inputs["advantages"]``.

The rest is a self-contained demo on CPU, no downloads, well under 3 minutes: a random-weight
Qwen2 model (2 layers, width 64) with the repository's Qwen2.5 tokenizer, and 2 GRPO steps with
agent-loop's ``calculator`` tool on a 3-question task. An untrained model never calls a tool, so
sampling is steered (``generation_kwargs={"sequence_bias": ...}``, see :func:`steering_bias`)
toward transcripts that call the calculator, read its result and answer, right or wrong; TRL's
real tool loop parses the call, runs the tool and masks its result. One question's answer is too
long for ``max_completion_length``, so TRL truncates it and (``mask_truncated_completions=True``)
masks the row out: its nonzero reward is dropped and counted (``agent_loop/dropped_rewards``).
The last line printed is ``AGENT_LOOP_TRL_RESULT {json}`` (losses, per-loss-call checks and the
first batch), which tests/integrations/test_trl_real.py reads.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from advantages.registry import get_estimator
from agent_loop.integrations.trl import sequence_rewards, trl_advantages
from agent_loop.models import build_random_model
from agent_loop.tasks.builtin import answer_reward, calculator
from masking.spans import SpanKind

REPO = Path(__file__).resolve().parents[1]


class SpanGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose loss gets agent-loop's token-level advantages ``(b, t)``.

    ``estimator``: a name in ``advantages.registry`` (``estimator_kwargs`` go to it, e.g.
    ``{"gamma": 0.95}``). A row TRL masked as truncated (``mask_truncated_completions=True``) has its
    reward dropped, counted in the metric ``agent_loop/dropped_rewards``; otherwise such a reward
    raises. NaN/inf rewards (TRL's NaN: every reward function returned None) raise ValueError.
    REINFORCE++ whitens over the ASSISTANT tokens of each process's generation batch.
    """

    def __init__(self, *args, estimator: str = "reinforce_plus_plus", estimator_kwargs: dict | None = None, **kwargs):
        self.estimator = get_estimator(estimator)  # an unknown name fails before TRL loads anything
        self.estimator_kwargs = dict(estimator_kwargs or {})
        self.checks: list[dict] = []  # one per loss call, filled when record_checks is set
        self.batches: list[dict] = []  # per generation batch: TRL's masks, our rewards and advantages
        self.record_checks = False
        super().__init__(*args, **kwargs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # the one place TRL has the per-sequence rewards (gathered over processes, (B_global, n_funcs))
        self._rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._rewards_per_func

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        b = output["completion_ids"].shape[0]
        start = self.accelerator.process_index * b  # TRL's own process slice
        rewards = sequence_rewards(self._rewards_per_func, self.reward_weights)[start:start + b]
        mode = "train" if self.model.training else "eval"
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        index = None
        if self.estimator.needs_index:
            if start % group_size or b % group_size:
                raise ValueError(f"{self.estimator.name} needs whole groups of {group_size} per process; got {b} rows")
            index = torch.arange(start, start + b, device=rewards.device) // group_size
        advantages, spans, metrics = trl_advantages(
            output["completion_mask"], output.get("tool_mask"), rewards, estimator=self.estimator.name, index=index,
            masked="drop" if self.mask_truncated_completions else "raise", **self.estimator_kwargs,
        )
        output["advantages"] = advantages  # TRL's loss takes (b, t) advantages as they are
        output["agent_loop_spans"] = spans  # travels with TRL's shuffles and splits, for loss_checks
        if self.record_checks:
            self.batches.append({"completion_mask": output["completion_mask"].tolist(), "rewards": rewards.tolist(),
                                 "tool_mask": output["tool_mask"].tolist() if "tool_mask" in output else None,
                                 "spans": spans.tolist(), "advantages": advantages.tolist()})
        for name, value in metrics.items():
            self._metrics[mode][f"agent_loop/{name}"].append(float(self.accelerator.gather(value).sum()))
        return output

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if self.record_checks:
            self.checks.append(loss_checks(inputs, loss))
        return loss


def loss_checks(inputs: dict, loss: torch.Tensor) -> dict:
    """What the loss saw: TRL's loss mask against our spans, where the advantages are nonzero."""
    tool_mask = inputs.get("tool_mask", torch.ones_like(inputs["completion_mask"]))
    trl_loss_mask = (inputs["completion_mask"] * tool_mask).bool()  # as TRL's _compute_loss builds it
    spans, advantages = inputs["agent_loop_spans"], inputs["advantages"]
    assistant, observation = spans == SpanKind.ASSISTANT, spans == SpanKind.OBSERVATION
    return {
        "loss": float(loss.detach()),
        "advantages_shape": list(advantages.shape),
        "trl_loss_mask_equals_spans": bool(torch.equal(trl_loss_mask, assistant)),
        "assistant_tokens": int(assistant.sum()),
        "tool_tokens": int(observation.sum()),
        "nonzero_advantages_on_assistant": int((advantages[assistant] != 0).sum()),
        # at ratio 1 (one update per generation) TRL's "dapo" loss is -sum(A * mask) / tokens
        "loss_from_advantages": -float((advantages * trl_loss_mask).sum() / trl_loss_mask.sum().clamp(min=1)),
        "max_abs_advantage_off_assistant": float(advantages[~assistant].abs().max()) if (~assistant).any() else 0.0,
        "masked_rows": int((~assistant.any(dim=1)).sum()),
    }


# --- the demo task: 3 arithmetic questions, the calculator tool ---------------------------------------

QUESTIONS = [  # (expression, final answers the sampling is steered to: a right and a wrong one -> reward variance)
    ("2+3", ["The answer is 5.", "The answer is 6."]),
    ("7*6", ["The answer is 42.", "The answer is 41."]),
    ("12-5", ["The calculator says 7, so twelve minus five is seven: subtracting five from twelve leaves seven, "
              "which is the answer to the question you asked me, and I am sure of it."]),  # too long: truncated
]


def transcript(expression: str, answer_text: str) -> list[dict]:
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return [{"role": "user", "content": f"What is {expression}?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": calculator(expression)},
            {"role": "assistant", "content": answer_text}]


def correct_answer(completions, answer, **kwargs) -> list[float]:
    """TRL reward function: agent-loop's answer reward (the final reply's last number)."""
    return [answer_reward(messages, a) for messages, a in zip(completions, answer)]


def used_calculator(completions, **kwargs) -> list[float]:
    """TRL reward function: 0.5 for calling the calculator (so a truncated row has a nonzero reward)."""
    return [0.5 * any(c.get("function", {}).get("name") == "calculator" for m in messages for c in m.get("tool_calls") or [])
            for messages in completions]


def steering_bias(tokenizer, bias: float = 30.0, anchor: int = 12) -> list:
    """``GenerationConfig.sequence_bias`` that makes the untrained random model say the transcripts.

    For every assistant segment of every transcript (the tool call, then the final answer), each
    prefix of the segment, preceded by the ``anchor`` tokens before it (which hold the question or
    the tool result), gets ``bias`` on its last token: +30 outweighs a 151k-token vocabulary (a
    random model's logits are near 0, so another token has odds below 1e-7), and two answers with
    a shared start are sampled about half and half. Only sampling is steered; TRL's loss uses the
    model's own log-probabilities (a trained model needs none of this).
    """
    sequences = {}
    for expression, answers in QUESTIONS:
        for text in answers:
            messages = transcript(expression, text)
            ids = tokenizer.apply_chat_template(messages, tools=[calculator], tokenize=True, return_dict=True)["input_ids"]
            for upto in (1, 3):  # the segments start after the user turn and after the tool result
                head = tokenizer.apply_chat_template(messages[:upto], tools=[calculator], tokenize=True,
                                                     add_generation_prompt=True, return_dict=True)["input_ids"]
                end = ids.index(tokenizer.convert_tokens_to_ids("<|im_end|>"), len(head))
                for last in range(len(head), end + 1):  # through the segment's <|im_end|>
                    sequences[tuple(ids[len(head) - anchor:last + 1])] = bias
    return [[list(sequence), value] for sequence, value in sequences.items()]


def build_model(out_dir: Path, tokenizer_dir: Path) -> Path:
    """Random Qwen2 (2 layers, width 64) with the tokenizer in ``tokenizer_dir``, saved in ``out_dir``."""
    return build_random_model(out_dir, "qwen2", tokenizer_dir, seed=0)


def repo_tokenizer_dir() -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    from testdata import qwen_tokenizer_dir  # the real Qwen2.5 tokenizer shipped in tests/data

    return qwen_tokenizer_dir()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps")
    parser.add_argument("--estimator", default="reinforce_plus_plus", help="a name in advantages.registry")
    parser.add_argument("--gamma", type=float, default=0.95)
    parser.add_argument("--max-completion-length", type=int, default=56)
    parser.add_argument("--no-mask-truncated", action="store_true", help="mask_truncated_completions=False")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="trl-grpo-tools-") as work:
        model_dir = build_model(Path(work) / "model", repo_tokenizer_dir())
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        dataset = Dataset.from_list([{"prompt": transcript(e, a[0])[:1], "answer": int(calculator(e))} for e, a in QUESTIONS])
        config = GRPOConfig(
            output_dir=str(Path(work) / "out"), max_steps=args.steps, per_device_train_batch_size=6,
            num_generations=2, max_completion_length=args.max_completion_length, learning_rate=1e-4,
            generation_kwargs={"sequence_bias": steering_bias(tokenizer)}, gradient_checkpointing=False,
            mask_truncated_completions=not args.no_mask_truncated, logging_steps=1, save_strategy="no",
            report_to="none", use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0,
        )
        trainer = SpanGRPOTrainer(
            model=str(model_dir), reward_funcs=[correct_answer, used_calculator], args=config, train_dataset=dataset,
            processing_class=tokenizer, tools=[calculator],
            estimator=args.estimator, estimator_kwargs=_estimator_kwargs(args),
        )
        trainer.record_checks = True
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    result = {
        "trl_steps": trainer.state.global_step,
        "seconds": round(time.perf_counter() - started, 1),
        "losses": [entry["loss"] for entry in logs],
        "grad_norms": [entry.get("grad_norm") for entry in logs],
        "trl_reward_means": [entry.get("reward") for entry in logs],
        "dropped_rewards": [entry.get("agent_loop/dropped_rewards") for entry in logs],
        "tool_calls": [entry.get("tools/call_frequency") for entry in logs],
        "checks": trainer.checks,
        "first_batch": trainer.batches[0],
    }
    print("AGENT_LOOP_TRL_RESULT " + json.dumps(result))
    return result


def _estimator_kwargs(args: argparse.Namespace) -> dict:
    return {"gamma": args.gamma} if "gamma" in get_estimator(args.estimator).hyperparameters else {}


if __name__ == "__main__":
    main()
