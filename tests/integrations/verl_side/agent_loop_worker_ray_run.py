"""Run inside the verl 0.9.1 side environment: verl's real ``AgentLoopWorker`` as a Ray actor, in the process
layout verl trains in. A small local Ray cluster is started as verl's ``main_ppo`` starts one; the worker is
created as ``AgentLoopManager`` creates it (``ray.remote(AgentLoopWorker).options(name=...).remote(config,
llm_client, teacher_client, reward_loop_worker_handles)``); the scripted token server
(``verl_worker_common.ScriptedServer``) is a Ray actor of its own, reached through a picklable client that
holds its actor handle, as verl's server manager holds its servers' handles.

Our AgentLoop reaches the worker actor only through ``VERL_USE_EXTERNAL_MODULES=agent_loop.integrations.
verl_register`` in the actor's Ray ``runtime_env``: this driver imports none of agent-loop (it records what it
loaded), and a second worker created without the variable fails with verl's unknown-agent-loop error.

    python agent_loop_worker_ray_run.py TOKENIZER_DIR WORK_DIR   # writes WORK_DIR/result.json
"""

import json
import os
import sys
from pathlib import Path
from uuid import uuid4

import ray
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker, _agent_loop_registry
from verl.trainer.constants_ppo import get_ppo_ray_runtime_env
from verl_worker_common import ScriptedServer, batch_of, dump, model_dir, row, trainer_config

EXTERNAL = "VERL_USE_EXTERNAL_MODULES"
REGISTER = "agent_loop.integrations.verl_register"


def ours_loaded() -> list[str]:
    """agent-loop's modules loaded in this process."""
    return sorted(m for m in sys.modules if m == "agent_loop" or m.startswith("agent_loop."))


@ray.remote(num_cpus=0)
class ScriptedServerActor:
    """The scripted server in a process of its own; ``calls()`` is what reached it."""

    def __init__(self, model: str):
        from transformers import AutoTokenizer

        self.server = ScriptedServer(AutoTokenizer.from_pretrained(model))

    async def generate(self, request_id, prompt_ids, sampling_params):
        return await self.server.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)

    def calls(self) -> list[dict]:
        return list(self.server.calls)

    def pid(self) -> int:
        return os.getpid()


class ScriptedClient:
    """The ``llm_client`` verl passes its workers as is: picklable, the server actor's handle inside."""

    def __init__(self, server):
        self.server = server

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        return await self.server.generate.remote(request_id, list(prompt_ids), dict(sampling_params))


def actor_state(worker) -> dict:
    """Run in a worker actor (``__ray_call__``): its process, environment variable, registry and our modules."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry as registry

    return {"pid": os.getpid(), "env": os.environ.get(EXTERNAL), "ours_loaded": ours_loaded(),
            "registry": {name: str(entry["_target_"]) for name, entry in registry.items()}}


def error_of(ref) -> str:
    try:
        ray.get(ref)
    except ray.exceptions.RayTaskError as error:  # what verl's AgentLoopManager would see
        cause = getattr(error, "cause", None) or error
        return f"{type(cause).__name__}: {cause}"
    return "no error"


def main(tokenizer_dir: Path, work: Path) -> dict:
    assert EXTERNAL not in os.environ, f"{EXTERNAL} must reach the worker through its runtime_env only"
    model = model_dir(tokenizer_dir, work)
    config = trainer_config(model, work)
    ray.init(num_cpus=2, include_dashboard=False, runtime_env=get_ppo_ray_runtime_env())
    try:
        server = ScriptedServerActor.remote(str(model))
        client = ScriptedClient(server)
        worker_class = ray.remote(AgentLoopWorker)  # as AgentLoopManager.__init__
        driver_before = ours_loaded()
        worker = worker_class.options(name=f"agent_loop_worker_0_{uuid4().hex[:8]}",
                                      runtime_env={"env_vars": {EXTERNAL: REGISTER}}).remote(config, client, None, None)
        unregistered = worker_class.options(name=f"agent_loop_worker_1_{uuid4().hex[:8]}").remote(
            config, client, None, None)
        tool_row = row('What is the code of "river"?', 0, "417", "agent_loop")
        out = ray.get(worker.generate_sequences.remote(batch_of([tool_row])))
        result = {"main": dump(out), "calls": ray.get(server.calls.remote()),
                  "worker": ray.get(worker.__ray_call__.remote(actor_state))}
        result["unregistered_error"] = error_of(unregistered.generate_sequences.remote(batch_of([tool_row])))
        result["unregistered_worker"] = ray.get(unregistered.__ray_call__.remote(actor_state))
        result["calls_after_unregistered"] = len(ray.get(server.calls.remote()))
        result["server_pid"] = ray.get(server.pid.remote())
        result["driver"] = {"pid": os.getpid(), "ours_loaded_before_actors": driver_before,
                            "ours_loaded_at_end": ours_loaded(), "registry": sorted(_agent_loop_registry)}
    finally:
        ray.shutdown()
    return result


if __name__ == "__main__":
    tokenizer_dir, work = Path(sys.argv[1]), Path(sys.argv[2])
    result = main(tokenizer_dir, work)
    (work / "result.json").write_text(json.dumps(result))
    print("wrote", work / "result.json")
