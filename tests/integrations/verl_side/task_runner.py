"""Run verl's ``ray_trainer.compute_advantage`` inside a Ray actor started as verl's ``main_ppo`` starts its
TaskRunner (``ray.init(runtime_env=get_ppo_ray_runtime_env())``, then ``TaskRunner.remote()``), in a side
environment with verl. Prints one JSON object: the batch, and per actor its outputs or its error.

    python task_runner.py driver-register   # register() in the driver only; a second actor gets
                                            # VERL_USE_EXTERNAL_MODULES through its Ray runtime_env
    VERL_USE_EXTERNAL_MODULES=agent_loop.integrations.verl_register AGENT_LOOP_VERL_REPLACE_GAE=1 \
        python task_runner.py shell         # the variables exported in the launching shell only
"""

import json
import sys

import ray
import torch

from agent_loop.integrations.verl_comparison import GROUPS_WITH_SINGLES, multi_turn_batch

ESTIMATORS = ("agent_loop_reinforce_plus_plus", "reinforce_plus_plus", "gae")


@ray.remote(num_cpus=0)
class TaskRunner:
    """What main_ppo's TaskRunner does with advantages: verl is first imported here, in the actor."""

    def run(self, rewards, values, mask, uids):
        import verl
        from verl import DataProto
        from verl.trainer.config import AlgoConfig
        from verl.trainer.ppo import core_algos
        from verl.trainer.ppo.ray_trainer import compute_advantage

        out = {"verl": verl.__version__, "gae_is_ours": core_algos.compute_gae_advantage_return.__module__}
        for estimator in ESTIMATORS:
            data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "values": values, "response_mask": mask},
                                       non_tensors={"uid": uids})
            try:
                result = compute_advantage(data, estimator, gamma=0.9, lam=0.95,
                                           config=AlgoConfig(gamma=0.9, lam=0.95, adv_estimator=estimator))
            except Exception as error:
                out[estimator] = {"error": f"{type(error).__name__}: {error}"}
                continue
            out[estimator] = {k: result.batch[k].tolist() for k in ("advantages", "returns")}
        out["agent_loops"] = agent_loops()
        return out


def agent_loops():
    """verl's agent-loop registry after verl imports its agent loops (our AgentLoop registers at that import)."""
    try:
        from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}
    return {name: dict(entry) for name, entry in _agent_loop_registry.items()}


def main(mode: str) -> None:
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    rewards, values, mask, uids, *_ = multi_turn_batch(0, torch.int64, GROUPS_WITH_SINGLES)
    if mode == "driver-register":
        from agent_loop.integrations import verl as plugin

        plugin.register()  # what a user tries first: it registers in this process only
    ray.init(num_cpus=1, include_dashboard=False, runtime_env=get_ppo_ray_runtime_env())
    try:
        runners = {"plain": TaskRunner.remote()}
        if mode == "driver-register":  # the cluster route: ray_kwargs.ray_init.runtime_env.env_vars
            env = {"env_vars": {"VERL_USE_EXTERNAL_MODULES": "agent_loop.integrations.verl_register"}}
            runners["runtime_env"] = TaskRunner.options(runtime_env=env).remote()
        results = {name: ray.get(runner.run.remote(rewards, values, mask, uids)) for name, runner in runners.items()}
    finally:
        ray.shutdown()
    batch = {"rewards": rewards.tolist(), "values": values.tolist(), "mask": mask.tolist(), "uids": list(uids)}
    print(json.dumps({"batch": batch, "actors": results}))


if __name__ == "__main__":
    main(sys.argv[1])
