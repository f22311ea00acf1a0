"""Three training steps of a random-weight model of Qwen2.5-0.5B's shape on a GPU: step time, tokens/s, peak memory.

    python benchmarks/train_step_gpu.py                      # H100/H200: bf16, 64 episodes of up to 256 tokens
    python benchmarks/train_step_gpu.py --dtype fp32
    python benchmarks/train_step_gpu.py --tiny --device cpu  # no GPU: the same script on a tiny shape (smoke test)

The model is built locally from a ``Qwen2Config`` with Qwen2.5-0.5B's dimensions (24 layers, hidden
896, 14 heads / 2 KV heads, vocabulary 151936, tied embeddings) and random weights, saved with the real
Qwen2.5 tokenizer shipped in tests/data (nothing is downloaded). The whole step runs on the device:
rollouts with the transformers backend (bf16 copy of the policy), the old-logprob recomputation,
REINFORCE++ returns (the Triton kernel on CUDA), the PPO-clip loss and AdamW (fp32 master weights,
bf16 autocast). A random model rarely calls a tool, so each episode is one turn of ``--max-tokens``
sampled tokens: the step's size is fixed by the flags, not by what the model learns.

Reported per step: rollout seconds, training seconds (scoring + update), training tokens/s (prompt +
response tokens of the batch through forward and backward, per training second), and the peak
device memory (``torch.cuda.max_memory_allocated``); the first step includes warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from agent_loop.training.step_rollouts import training_batch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(QWEN25_05B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model of the same vocabulary (smoke test)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args()


def build_model(folder: Path, shape: dict) -> None:
    """A random-weight Qwen2 causal LM of ``shape``, saved with the Qwen2.5 tokenizer and chat template."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from tests.helpers.testdata import qwen_tokenizer_dir

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    config = Qwen2Config(**shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from agent_loop import TrainConfig, Trainer

    console = Console()
    with tempfile.TemporaryDirectory(prefix="train-step-gpu-") as scratch:
        model_dir = Path(scratch) / "model"
        build_model(model_dir, TINY if args.tiny else QWEN25_05B)
        config = TrainConfig.from_flat(
            model=str(model_dir), steps=args.steps, prompts_per_step=args.prompts_per_step,
            group_size=args.group_size, concurrency=args.prompts_per_step * args.group_size, max_turns=1,
            max_tokens=args.max_tokens, max_response_tokens=args.max_tokens, mini_batches=2,
            micro_batch_size=args.micro_batch_size, entropy_coef=0.01, device=args.device, dtype=args.dtype,
            threads=args.threads, output_dir=str(Path(scratch) / "run"), save_every=10**9, progress=False,
        )
        built = time.perf_counter()
        trainer = Trainer(config)
        console.print(f"set-up {time.perf_counter() - built:.1f} s")
        cuda = trainer.device.type == "cuda"
        name = torch.cuda.get_device_name(trainer.device) if cuda else "cpu"
        parameters = sum(p.numel() for p in trainer.policy.parameters())
        console.print(f"device {name}, dtype {args.dtype}, {parameters / 1e6:.0f} M parameters, "
                      f"{config.episodes_per_step} episodes/step, up to {args.max_tokens} response tokens")
        rows = []
        for _ in range(args.steps):
            if cuda:
                torch.cuda.reset_peak_memory_stats(trainer.device)
                torch.cuda.synchronize(trainer.device)
            started = time.perf_counter()
            trajectories = trainer.rollouts.play_groups(trainer.step * trainer.config.rollout.prompts_per_step)
            if cuda:
                torch.cuda.synchronize(trainer.device)
            rolled = time.perf_counter()
            batch = training_batch(trajectories, group_size=trainer.config.run.group_size,
                                   pad_token_id=trainer.pad_token_id, device=trainer.device)
            trainer.ppo.score(batch)
            trainer.ppo.update(batch, trainer.step)
            trainer.push_weights()
            if cuda:
                torch.cuda.synchronize(trainer.device)
            done = time.perf_counter()
            trainer.step += 1
            tokens = int(batch["attention_mask"].sum())
            peak = torch.cuda.max_memory_allocated(trainer.device) / 2**30 if cuda else float("nan")
            rows.append((rolled - started, done - rolled, tokens, tokens / (done - rolled), peak))
            # each step as it ends: a run cut short (a device lease) keeps what it measured
            console.print(f"step {len(rows)}: rollout {rows[-1][0]:.2f} s, train {rows[-1][1]:.2f} s, {tokens} tokens, "
                          f"{rows[-1][3]:,.0f} tokens/s, peak {peak:.1f} GiB")

    table = Table(title=f"train_step_gpu: {name}, {args.dtype}{' (tiny shape)' if args.tiny else ''}")
    for column in ("step", "rollout s", "train s", "batch tokens", "train tokens/s", "peak GiB"):
        table.add_column(column, justify="right")
    for number, (rollout, train, tokens, rate, peak) in enumerate(rows, start=1):
        table.add_row(str(number), f"{rollout:.2f}", f"{train:.2f}", str(tokens), f"{rate:,.0f}", f"{peak:.1f}")
    console.print(table)
    if len(rows) > 1:
        steady = rows[1:]
        console.print(f"after warm-up: train {statistics.median(r[1] for r in steady):.2f} s/step, "
                      f"{statistics.median(r[3] for r in steady):,.0f} tokens/s, rollout "
                      f"{statistics.median(r[0] for r in steady):.2f} s/step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
