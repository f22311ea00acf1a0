"""Peak RSS of one training step against batch size and sequence length: the chunked output head (the trainer's,
agent_loop/training/policy.py ``chunked_head``) against the unchunked one (the whole ``(b, t, v)`` float32 logits, as before
issue 36), and against the step's floor, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/train_memory.py                          # smollm2-135m if built in, else the tiny agent
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/train_memory.py --model PATH --rows 2 8 --response-tokens 128 256

Each measurement is a fresh process (peak RSS is per process): load the policy (fp32, as the trainer), run one
warm-up step (AdamW allocates its state), reset the peak (``/proc/self/clear_refs``), run one more step and read
``VmHWM``. A step is the trainer's: the no-gradient recompute of old logprobs (``batch_logprobs``; with
``--reference`` also the frozen reference's, for the KL), then micro-batches of ``--micro-batch-size`` rows through
the policy forward (logprobs and entropy), the dual-clip PPO loss, backward, gradient clipping and AdamW. Rows are
``--shared-prompt`` tokens every row shares (the system prompt and tool schemas), ``--own-prompt`` of their own, and
``--response-tokens`` ASSISTANT tokens, random ids.

The floor: the process before the model (Python, torch, transformers: ``base``), plus weights, gradients and AdamW's
two moments (16 bytes per trained parameter; 4 per frozen one: a LoRA base, the reference), plus one micro-batch's activations
(the bytes autograd saves for backward in one micro-batch's forward, measured with saved-tensor hooks, weights
excluded) and one piece of logits (logits, log-softmax and softmax of ``LOGITS_CHUNK_TOKENS`` tokens).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

MIB = 2**20


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a model folder or a built-in model name "
                        "(default smollm2-135m; the tiny agent when that is not built in)")
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 8, 16], help="rows per step (batch sizes)")
    parser.add_argument("--response-tokens", type=int, nargs="+", default=[128, 256], help="sequence lengths")
    parser.add_argument("--micro-batch-size", type=int, default=16, help="rows per forward/backward (train's default)")
    parser.add_argument("--shared-prompt", type=int, default=200)
    parser.add_argument("--own-prompt", type=int, default=24)
    parser.add_argument("--reference", action="store_true", help="also a frozen reference model (--kl-coef > 0)")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="train a LoRA adapter of this rank (train's --lora-rank, its default alpha and targets)")
    parser.add_argument("--modes", nargs="+", default=["chunked", "whole"], choices=("chunked", "whole"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def resolve_model(name: str) -> tuple[str, str]:
    """``(folder, label)``: a folder as given, a built-in name through agent_loop.model_folders, else the tiny agent."""
    from agent_loop.model_folders import model_path

    if Path(name).is_dir():
        return name, Path(name).name
    try:
        folder = model_path(name)
    except (ValueError, OSError) as error:
        print(f"note: {name}: {error}; measuring the tiny agent", file=sys.stderr)
        folder = None
    if folder is None or not Path(folder).is_dir():
        print(f"note: {name} is not a built-in model here; measuring the tiny agent", file=sys.stderr)
        return model_path(None), "tiny agent"
    return folder, name


# --- one measurement (a child process) -------------------------------------------------------------


def vm_status(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def synthetic_batch(vocabulary: int, rows: int, shared: int, own: int, response: int):
    """A collated batch: prompts of ``shared`` common and ``own`` per-row tokens, ``response`` ASSISTANT tokens."""
    import torch

    from masking.batch import Batch
    from masking.kinds import SpanKind

    generator = torch.Generator().manual_seed(0)
    prompts = torch.cat([torch.randint(vocabulary, (1, shared), generator=generator).expand(rows, -1),
                         torch.randint(vocabulary, (rows, own), generator=generator)], dim=1)
    responses = torch.randint(vocabulary, (rows, response), generator=generator)
    width = shared + own + response
    zeros = torch.zeros(rows, response)
    return Batch(responses=responses, spans=torch.full((rows, response), int(SpanKind.ASSISTANT), dtype=torch.int8),
                 response_mask=torch.ones(rows, response), turn_ids=torch.zeros(rows, response, dtype=torch.int16),
                 old_logprobs=zeros.clone(), token_level_rewards=zeros.clone(), prompts=prompts,
                 input_ids=torch.cat([prompts, responses], dim=1), attention_mask=torch.ones(rows, width, dtype=torch.long),
                 position_ids=torch.arange(width).expand(rows, -1).contiguous(),
                 advantages=torch.randn(rows, response, generator=generator))


def whole_logits_policy(model):
    """The policy forward before issue 36: the whole ``(b, t, v)`` float32 logits, then logprobs and entropy."""
    from advantages import entropy_from_logits
    from agent_loop.training.policy import PolicyModel, ResponseInputs, response_forward, token_logprobs

    class WholeLogits(PolicyModel):
        def forward(self, prompts, input_ids, attention_mask, position_ids, responses, *, entropy: bool = True):
            inputs = ResponseInputs(prompts, input_ids, attention_mask, position_ids, responses)
            logits, values = response_forward(self.model, inputs, self.value_head, self.share_prefix)
            return token_logprobs(logits, responses), entropy_from_logits(logits) if entropy else None, values

    return WholeLogits(model)


def train_step(policy, reference, optimizer, batch, micro_batch_size: int) -> None:
    """One step as the trainer's: recompute (and reference) logprobs, PPO loss per micro-batch, backward, AdamW."""
    import torch

    from advantages import ppo_clip_policy_loss
    from agent_loop.training.policy import batch_logprobs, micro_batches, policy_outputs

    batch.old_logprobs, _ = batch_logprobs(policy, batch, micro_batch_size)
    if reference is not None:
        batch_logprobs(reference, batch, micro_batch_size)
    rows = torch.arange(batch.batch_size)
    tokens = batch.response_mask.sum()
    for _, micro in micro_batches(batch, rows, micro_batch_size):
        logprobs, _, _ = policy_outputs(policy, micro)  # entropy computed, as the trainer logs it
        loss, _ = ppo_clip_policy_loss(micro.old_logprobs, logprobs, micro.advantages, micro.response_mask)
        (loss * micro.response_mask.sum() / tokens).backward()  # entropy_coef 0 (the default): no bonus
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def activation_bytes(policy, batch, micro_batch_size: int) -> int:
    """Bytes autograd saves for backward in one micro-batch's chunked forward (parameters excluded)."""
    import torch

    from agent_loop.training.policy import micro_batches, policy_outputs

    weights = {p.untyped_storage().data_ptr() for p in policy.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    _, micro = next(micro_batches(batch, torch.arange(batch.batch_size), micro_batch_size))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        outputs = policy_outputs(policy, micro)
    del outputs
    return sum(storages.values())


def measure(spec: dict) -> dict:
    """One (mode, rows, response tokens) measurement in this process (see the module docstring)."""
    import torch
    import transformers  # noqa: F401  (imported before the base RSS is read: it is not the step's memory)
    from transformers import AutoModelForCausalLM

    from agent_loop.training.policy import LOGITS_CHUNK_TOKENS, PolicyModel

    torch.set_num_threads(1)
    base = vm_status("VmRSS")
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).train()
    if spec["lora"]:
        from agent_loop.recipes.train_options import TrainConfig
        from agent_loop.training.lora import wrap_with_lora

        defaults = TrainConfig().run
        model = wrap_with_lora(model, spec["lora"], defaults.lora_alpha, defaults.lora_target_modules)
    policy = PolicyModel(model) if spec["mode"] == "chunked" else whole_logits_policy(model)
    reference = None
    if spec["reference"]:
        reference = PolicyModel(AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
                                .requires_grad_(False))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    vocabulary = model.config.vocab_size
    batch = synthetic_batch(vocabulary, spec["rows"], spec["shared_prompt"], spec["own_prompt"], spec["response_tokens"])
    train_step(policy, reference, optimizer, batch, spec["micro_batch_size"])  # warm-up: AdamW's state exists after it
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    started = time.perf_counter()
    train_step(policy, reference, optimizer, batch, spec["micro_batch_size"])
    seconds = time.perf_counter() - started
    peak = vm_status("VmHWM")
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)  # LoRA: the base
    frozen += sum(p.numel() for p in reference.parameters()) if reference is not None else 0
    activations = activation_bytes(PolicyModel(model), batch, spec["micro_batch_size"])
    floor = base + 16 * trained + 4 * frozen + activations + 3 * LOGITS_CHUNK_TOKENS * vocabulary * 4
    return {**spec, "peak": peak, "floor": floor, "base": base, "activations": activations, "seconds": seconds,
            "parameters": trained + frozen, "trained": trained, "vocabulary": vocabulary}


# --- the run: one child per measurement, one table ---------------------------------------------------


def run_child(spec: dict) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
    if done.returncode != 0:
        return {**spec, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(results: list[dict], label: str) -> None:
    from rich.console import Console
    from rich.table import Table

    first = next((r for r in results if "error" not in r), {})
    trained = f", LoRA rank {first['lora']}: {first['trained'] / 1e6:.2f}M trained" if first.get("lora") else ""
    table = Table(title=f"peak RSS of one training step, {label} ({first.get('parameters', 0) / 1e6:.1f}M parameters"
                        f"{trained}, vocabulary {first.get('vocabulary', 0):,}), MiB")
    for column in ("rows", "response tokens", "floor", "chunked", "chunked / floor", "whole logits",
                   "whole / floor", "whole / chunked", "step s (chunked, whole)"):
        table.add_column(column, justify="right")
    keys = sorted({(r["rows"], r["response_tokens"]) for r in results})
    for rows, tokens in keys:
        by_mode = {r["mode"]: r for r in results if (r["rows"], r["response_tokens"]) == (rows, tokens)}
        chunked, whole = by_mode.get("chunked", {}), by_mode.get("whole", {})
        floor = chunked.get("floor") or whole.get("floor")

        def mib(r):
            return r.get("error", "-")[:40] if "peak" not in r else f"{r['peak'] / MIB:,.0f}"

        def ratio(a, b):
            return f"{a['peak'] / b:.2f}" if "peak" in a and b else "-"

        table.add_row(str(rows), str(tokens), f"{floor / MIB:,.0f}" if floor else "-", mib(chunked),
                      ratio(chunked, floor), mib(whole), ratio(whole, floor),
                      ratio(whole, chunked.get("peak")), " / ".join(f"{r['seconds']:.1f}" for r in (chunked, whole)
                                                                      if "seconds" in r))
    Console(width=200).print(table)
    for r in results:
        print(json.dumps(r))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure(json.loads(args.child))))
        return
    folder, label = resolve_model(args.model)
    results = []
    for rows in args.rows:
        for tokens in args.response_tokens:
            for mode in args.modes:
                spec = dict(model=folder, mode=mode, rows=rows, response_tokens=tokens, reference=args.reference, lora=args.lora,
                            micro_batch_size=args.micro_batch_size, shared_prompt=args.shared_prompt,
                            own_prompt=args.own_prompt)
                results.append(run_child(spec))
                print(f"{mode} rows {rows} tokens {tokens}: " + (results[-1].get("error") or
                      f"{results[-1]['peak'] / MIB:,.0f} MiB peak, floor {results[-1]['floor'] / MIB:,.0f} MiB"),
                      file=sys.stderr, flush=True)
    print_table(results, label)


if __name__ == "__main__":
    main()
