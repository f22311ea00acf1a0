"""TRL's ``GRPOTrainer`` with tools, trained on agent-loop's spans and carry-through advantages.

    python examples/trl_grpo_tools.py              # in an environment with TRL (docs/trl.md)

``SpanGRPOTrainer`` (``agent_loop.integrations.trl``, shipped in the package) is the recipe: a
``trl.GRPOTrainer`` subclass that keeps TRL's generation, tool loop, reward functions and loss, and
replaces only the advantages with a registered estimator's ``(b, t)`` advantages (default
REINFORCE++, carry-through returns, gamma 1: with per-batch whitening a discount below 1 would give
a wrong answer's final tokens a positive advantage, docs/trl.md).

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
from trl import GRPOConfig

from advantages.registry import get_estimator
from agent_loop.integrations.trl import SpanGRPOTrainer
from agent_loop.model_folders import build_random_model
from agent_loop.tasks.builtin import answer_reward, calculator

REPO = Path(__file__).resolve().parents[1]


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
    sys.path.insert(0, str(REPO))  # tests.helpers
    from tests.helpers.testdata import qwen_tokenizer_dir  # the real Qwen2.5 tokenizer shipped in tests/data

    return qwen_tokenizer_dir()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="GRPO steps")
    parser.add_argument("--estimator", default="reinforce_plus_plus", help="a name in advantages.registry")
    parser.add_argument("--gamma", type=float, default=1.0,
                        help="below 1, per-batch whitening can make a wrong answer's last tokens positive (docs/trl.md)")
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
    """The estimator's settings instance with ``--gamma`` (advantages/settings.py), for an estimator that has one."""
    settings = get_estimator(args.estimator).settings
    return {"settings": settings(gamma=args.gamma)} if settings is not None else {}


if __name__ == "__main__":
    main()
