"""Per-turn loop overhead of our AgentLoop against verl's own ``tool_agent`` loop, in the same verl
``AgentLoopWorker``, on one zero-latency scripted server, in one run.

Runs inside the verl 0.9.1 side environment (``bash scripts/side_env.sh verl-0.9.1``). verl's real
``AgentLoopWorker`` (built from verl's composed ``ppo_trainer`` config, as
tests/integrations/verl_side/agent_loop_worker_run.py builds it) runs batches whose ``agent_name`` column is
``tool_agent`` (verl's ``ToolAgentLoop``) or ``agent_loop`` (ours, agent_loop/integrations/verl_agent_loop.py),
with the same Qwen2.5 tokenizer and chat template (tests/data/tokenizers), the same verl tool
(``verl_side_tools.CodeLookupTool`` from verl's tool config), the same rows and the same canned replies: the
server returns precomputed token ids and logprobs, ``turns - 1`` hermes tool calls then a final answer, so
every episode plays exactly ``turns`` assistant turns. A batch of ``concurrency`` rows is one
``generate_sequences`` call (its episodes run concurrently in the worker's event loop).

Per turn = (batch wall time - time inside the server's ``generate``) / (rows x turns): the loop's chat
formatting, parsing, tool dispatch (the tool itself is a dict lookup) and bookkeeping, plus verl's
per-row and per-batch postprocessing (padding into tensors, the same code for both loops); the "loop only"
column also leaves out verl's ``_agent_loop_postprocess`` and ``_postprocess``; the "own" column also leaves
out verl's per-row ``hydra.utils.instantiate`` of the loop class less the class's own ``__init__`` (hydra's
config merge, the same for both): what is left is each loop's ``__init__`` and ``run``. Our loop also scores the
row (``+agent_loop.reward=number``); verl's leaves that to its reward manager, outside the worker.
Loops are interleaved per repetition so machine load hits both alike. "same ids" checks that both loops
gave identical prompts, responses, masks and logprobs.

    .side-envs/verl-0.9.1/bin/python benchmarks/verl_loop_overhead.py [--concurrency 1 8 32] [--turns 2 4]
        [--repeats 5] [--statistic median|min] [--quick] [--json PATH]
"""

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the verl worker setup the integration tests use (config, rows, the verl tool) and the test tokenizer
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "integrations" / "verl_side")]

import hydra.utils  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker  # noqa: E402
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop  # noqa: E402
from verl.workers.rollout.replica import TokenOutput  # noqa: E402
from verl_worker_common import RESPONSE_LENGTH, batch_of, model_dir, row, trainer_config  # noqa: E402

from agent_loop.backends.scripted import scripted_logprob  # noqa: E402
from agent_loop.integrations.verl_agent_loop import AgentLoop  # noqa: E402  (registers "agent_loop" in verl's registry)
from tests.helpers.testdata import qwen_tokenizer_dir  # noqa: E402

LOOPS = ("tool_agent", "agent_loop")  # verl's, ours
STATISTICS = {"median": statistics.median, "min": min}
COMPARED = ("prompts", "responses", "response_mask", "attention_mask", "rollout_log_probs")
CALL = '<tool_call>\n{"name": "code_lookup", "arguments": {"key": "river"}}\n</tool_call><|im_end|>'
ANSWER = "The answer is 417.<|im_end|>"


class CannedServer:
    """verl's server manager ``generate``: canned ids per turn of a request id, timed so it can be subtracted."""

    def __init__(self):
        self.replies: list[tuple[list[int], list[float]]] = []
        self.turn_of: dict[str, int] = {}
        self.seconds = 0.0

    def script(self, tokenizer, turns: int) -> None:
        """Episodes of ``turns`` assistant turns: ``turns - 1`` tool calls, then the answer."""
        def reply(text):
            ids = tokenizer.encode(text, add_special_tokens=False)
            return ids, [scripted_logprob(t) for t in ids]

        self.replies = [reply(CALL)] * (turns - 1) + [reply(ANSWER)]

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        started = time.perf_counter()
        turn = self.turn_of.get(request_id, 0)
        self.turn_of[request_id] = turn + 1
        ids, logprobs = self.replies[min(turn, len(self.replies) - 1)]
        out = TokenOutput(token_ids=list(ids), log_probs=list(logprobs), num_preempted=0)
        self.seconds += time.perf_counter() - started
        return out


def time_postprocessing(worker: AgentLoopWorker, clock: dict) -> None:
    """Wrap verl's per-row and per-batch postprocessing with timers (shared by both loops)."""
    per_row, per_batch = worker._agent_loop_postprocess, worker._postprocess

    async def agent_loop_postprocess(*args, **kwargs):
        started = time.perf_counter()
        try:
            return await per_row(*args, **kwargs)
        finally:
            clock["post"] += time.perf_counter() - started

    def postprocess(*args, **kwargs):
        started = time.perf_counter()
        try:
            return per_batch(*args, **kwargs)
        finally:
            clock["post"] += time.perf_counter() - started

    worker._agent_loop_postprocess, worker._postprocess = agent_loop_postprocess, postprocess


def time_instantiation(clock: dict) -> None:
    """Time verl's per-row ``hydra.utils.instantiate`` of the agent loop and, inside it, each loop class's own
    ``__init__``: ``clock["hydra"]`` gets the instantiation less the ``__init__`` (hydra's config merge, the
    same for both loops), so that the "own" columns keep each loop's ``__init__`` and ``run`` only."""
    instantiate = hydra.utils.instantiate  # verl's worker looks it up on hydra.utils at every row

    def timed_instantiate(*args, **kwargs):
        started, inits = time.perf_counter(), clock["init"]
        try:
            return instantiate(*args, **kwargs)
        finally:
            clock["hydra"] += time.perf_counter() - started - (clock["init"] - inits)

    for cls in (ToolAgentLoop, AgentLoop):
        def timed_init(self, *args, __init=cls.__init__, **kwargs):
            started = time.perf_counter()
            try:
                __init(self, *args, **kwargs)
            finally:
                clock["init"] += time.perf_counter() - started
        functools.update_wrapper(timed_init, cls.__init__)
        cls.__init__ = timed_init
    hydra.utils.instantiate = timed_instantiate


def make_worker(work: Path, max_turns: int):
    config = trainer_config(model_dir(qwen_tokenizer_dir(), work), work)
    rollout = config.actor_rollout_ref.rollout
    rollout.response_length = max(RESPONSE_LENGTH, 48 * max_turns)  # room for every turn: none is truncated
    OmegaConf.update(config, "agent_loop.loop", {"max_turns": max_turns}, force_add=True)
    server = CannedServer()
    worker = AgentLoopWorker(config, server)
    clock = {"post": 0.0, "hydra": 0.0, "init": 0.0}
    time_postprocessing(worker, clock)
    time_instantiation(clock)
    return worker, server, clock


async def play(worker, server, clock, loop: str, concurrency: int, turns: int):
    """One batch: (seconds per turn, loop-only seconds per turn, own seconds per turn, output)."""
    rows = [row('What is the code of "river"?', i, "417", loop) for i in range(concurrency)]
    server.turn_of.clear()
    server.seconds, clock["post"], clock["hydra"] = 0.0, 0.0, 0.0
    started = time.perf_counter()
    out = await worker.generate_sequences(batch_of(rows))
    wall = time.perf_counter() - started
    num_turns = out.non_tensor_batch["__num_turns__"].tolist()
    assert num_turns == [2 * turns] * concurrency, f"{loop}: turns {num_turns}, wanted {2 * turns} per row"
    n = concurrency * turns
    loop_only = wall - server.seconds - clock["post"]
    return (wall - server.seconds) / n, loop_only / n, (loop_only - clock["hydra"]) / n, out


def same_ids(a, b) -> bool:
    return all(torch.equal(a.batch[k], b.batch[k]) for k in COMPARED)


async def measure(worker, server, clock, concurrency: int, turns: int, repeats: int, statistic=statistics.median) -> dict:
    server.script(worker.tokenizer, turns)
    first = {loop: (await play(worker, server, clock, loop, concurrency, turns))[3] for loop in LOOPS}  # warm-up
    times = {loop: ([], [], []) for loop in LOOPS}
    for _ in range(repeats):
        for loop in LOOPS:
            *seconds, _ = await play(worker, server, clock, loop, concurrency, turns)
            for kept, value in zip(times[loop], seconds):
                kept.append(value)
    result = {"concurrency": concurrency, "turns": turns, "same_ids": same_ids(*first.values())}
    for loop in LOOPS:
        result[loop] = {"ms_per_turn": statistic(times[loop][0]) * 1e3,
                        "loop_only_ms_per_turn": statistic(times[loop][1]) * 1e3,
                        "own_ms_per_turn": statistic(times[loop][2]) * 1e3}
    return result


def print_table(results: list[dict], repeats: int, statistic: str = "median") -> None:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    table = Table(title=f"per-turn loop overhead in verl's AgentLoopWorker, zero-latency canned server "
                        f"({statistic} of {repeats}; {os.cpu_count()} CPUs, load average {load})")
    for column in ("rows", "turns", "verl tool_agent ms/turn", "ours ms/turn", "ours/theirs",
                   "loop only: verl", "loop only: ours", "ours/theirs (loop only)", "own: verl", "own: ours",
                   "ours/theirs (own)", "same ids"):
        table.add_column(column, justify="right")
    for r in results:
        theirs, ours = r["tool_agent"], r["agent_loop"]
        table.add_row(str(r["concurrency"]), str(r["turns"]), f"{theirs['ms_per_turn']:.3f}",
                      f"{ours['ms_per_turn']:.3f}", f"{ours['ms_per_turn'] / theirs['ms_per_turn']:.2f}x",
                      f"{theirs['loop_only_ms_per_turn']:.3f}", f"{ours['loop_only_ms_per_turn']:.3f}",
                      f"{ours['loop_only_ms_per_turn'] / theirs['loop_only_ms_per_turn']:.2f}x",
                      f"{theirs['own_ms_per_turn']:.3f}", f"{ours['own_ms_per_turn']:.3f}",
                      f"{ours['own_ms_per_turn'] / theirs['own_ms_per_turn']:.2f}x",
                      "yes" if r["same_ids"] else "NO")
    Console(width=200).print(table)


async def run(args) -> list[dict]:
    with tempfile.TemporaryDirectory() as work:
        worker, server, clock = make_worker(Path(work), max(args.turns))
        statistic = STATISTICS[args.statistic]
        return [await measure(worker, server, clock, c, t, args.repeats, statistic)
                for t in args.turns for c in args.concurrency]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="rows per batch")
    parser.add_argument("--turns", type=int, nargs="+", default=[2, 4], help="assistant turns per episode")
    parser.add_argument("--repeats", type=int, default=5, help="timed batches per loop and size")
    parser.add_argument("--statistic", choices=sorted(STATISTICS), default="median",
                        help="of the timed batches: median, or min (the least disturbed batch, on a loaded machine)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 and 4 rows, 2 turns, 1 repeat")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.turns, args.repeats = [1, 4], [2], 1
    if min(args.concurrency + args.turns + [args.repeats]) < 1 or min(args.turns) < 2:
        parser.error("--concurrency and --repeats must be >= 1 and --turns >= 2 (a tool call, then the answer)")
    torch.set_num_threads(1)
    results = asyncio.run(run(args))
    print_table(results, args.repeats, args.statistic)
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results, "load_average": os.getloadavg()}, indent=1))


if __name__ == "__main__":
    main()
