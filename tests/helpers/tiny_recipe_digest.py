"""A recorded digest of a short pinned build of the tiny agent's recipe (tests/tiny/test_shipped.py).

The full reproduction (all of :func:`agent_loop.training.tiny_agent.build_recipe`: 1000 training steps, the "mid" search and
the evaluations) takes over 11 minutes on one core. This runs the same recipe, in the same pinned child
process (:mod:`agent_loop.tiny.pinned`), and stops it after its first SHORT_STEPS training steps: the
tokenizer, the model's shape, the data, the seed, the optimizer and the learning-rate schedule (of the full
1000 steps) are all the recipe's own, so a change to any of them changes the weights at that step.

The record holds the sha256 of the tokenizer and of the weights (bit-identity: expected on this machine's
CPU maker, see :func:`agent_loop.tiny.pinned.can_pin`), and, for other CPUs, the weights' per-tensor norms and
a held-out loss, compared within a tolerance.

Regenerate it after a deliberate recipe change (and bump ``RECIPE_VERSION``)::

    .venv/bin/python -m tests.helpers.tiny_recipe_digest
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

SHORT_STEPS = 40  # past the 30 warm-up steps, so the cosine part of the schedule (which knows the total) counts
DIGEST_FILE = Path(__file__).resolve().parents[1] / "data" / "tiny_recipe_digest.json"


class _Stopped(Exception):
    """Raised at SHORT_STEPS to end the recipe there."""


def cpu_vendor() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")), "unknown")


def weights_sha256(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def short_record(tokenizer, model, steps: int, checkpoint_steps, seed: int) -> dict:
    """What the recipe made by SHORT_STEPS: exact digests, and the numbers a tolerance compares."""
    import torch

    from agent_loop.tiny.pinned import numerics
    from agent_loop.tiny.train import training_batch
    from agent_loop.training.finetune import labelled_loss

    with torch.no_grad():  # a batch far past any the short build trained on
        total, count = 0.0, 0
        for input_ids, labels in training_batch(tokenizer, 100_000, seed):
            loss, n = labelled_loss(model, input_ids, labels)
            total, count = total + float(loss), count + n
    return {"short_steps": SHORT_STEPS, "train_steps": steps, "checkpoint_steps": list(checkpoint_steps),
            "seed": seed, "vocab_size": len(tokenizer),
            "tokenizer_sha256": hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest(),
            "weights_sha256": weights_sha256(model), "held_out_loss": total / count,
            "norms": {name: float(t.double().norm()) for name, t in sorted(model.state_dict().items())},
            "numerics": numerics(), "cpu_vendor": cpu_vendor()}


def short_build(out: str) -> None:
    """Run the recipe until SHORT_STEPS and write its record to ``out`` (run in the pinned child)."""
    from agent_loop.training import tiny_agent

    real_train = tiny_agent.train

    def train_until_short(tokenizer, steps, seed, checkpoint_steps, on_checkpoint, progress):
        def stop(step, model):
            Path(out).write_text(json.dumps(short_record(tokenizer, model, steps, checkpoint_steps, seed), indent=2))
            raise _Stopped

        return real_train(tokenizer, steps, seed, (SHORT_STEPS,), stop, False)

    tiny_agent.train = train_until_short  # this child process only
    with tempfile.TemporaryDirectory() as folder:
        try:
            tiny_agent.build_recipe(folder, "")
        except _Stopped:
            return
    raise RuntimeError("the recipe finished without reaching its training")


def run_short_build(out: Path) -> dict:
    """The short pinned build's record (written to ``out``)."""
    from agent_loop.tiny.pinned import run_pinned

    run_pinned(f"{__name__}:{short_build.__name__}", str(out))
    return json.loads(out.read_text())


def main() -> None:
    import agent_loop.files as files
    from tests.helpers import tiny_recipe_digest  # by its importable name: the pinned child imports short_build

    with tempfile.TemporaryDirectory() as folder:
        record = tiny_recipe_digest.run_short_build(Path(folder) / "digest.json")
    files.write_text(DIGEST_FILE, json.dumps(record, indent=2) + "\n")
    print(f"wrote {DIGEST_FILE} (weights sha256 {record['weights_sha256']})", file=sys.stderr)


if __name__ == "__main__":
    main()
