"""Compose verl's ``ppo_trainer`` config with the Hydra overrides given as arguments (as ``python -m
verl.trainer.main_ppo ARGS`` would, through Hydra's compose API), build ``ray.init``'s keyword arguments the
way ``main_ppo.run_ppo`` does, and validate their ``runtime_env`` with Ray's own ``RuntimeEnv`` (what
``ray.init`` runs first), without starting a cluster. Prints ``{"env_vars": ...}`` or ``{"error": ...}``.
"""

import json
import sys
from pathlib import Path

import verl.trainer.main_ppo  # noqa: F401  (the module whose ray.init arguments are rebuilt below)
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from ray.runtime_env import RuntimeEnv
from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

CONFIG_DIR = Path(verl.trainer.main_ppo.__file__).parent / "config"


def ray_init_kwargs(config) -> dict:
    """main_ppo.run_ppo's ``ray.init`` arguments (verl 0.9.1), the transfer-queue branch aside."""
    default_runtime_env = get_ppo_ray_runtime_env(config)
    ray_init = config.ray_kwargs.get("ray_init", {})
    runtime_env = OmegaConf.merge(default_runtime_env, ray_init.get("runtime_env", {}))
    return OmegaConf.to_container(OmegaConf.create({**ray_init, "runtime_env": runtime_env}))


def main() -> None:
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=sys.argv[1:])
    kwargs = ray_init_kwargs(config)
    try:
        RuntimeEnv(**kwargs["runtime_env"])
    except (TypeError, ValueError) as error:
        print(json.dumps({"error": f"{type(error).__name__}: {error}"}))
        return
    print(json.dumps({"env_vars": kwargs["runtime_env"]["env_vars"]}))


if __name__ == "__main__":
    main()
