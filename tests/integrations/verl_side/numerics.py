"""verl's real ``core_algos`` estimators on the batches of ``verl_check.multi_turn_batch``, in a side
environment with verl: float64 masks, int64 masks with groups of one (as verl's agent loop emits), bf16
rewards and values, and dense bf16 rewards (one on every ASSISTANT token, as a per-token reward). Prints one JSON object ``{case: [{"inputs": ..., "outputs": {name: {"advantages", "returns", "dtype"}}}]}``; the
test compares the outputs with ``advantages`` and the serial references (tests/helpers/reference_returns.py).
"""

import json
from types import SimpleNamespace

import torch
from verl.trainer.ppo import core_algos as verl

from agent_loop.integrations.verl_comparison import GROUPS, GROUPS_WITH_SINGLES, multi_turn_batch

CASES = {  # name: (mask dtype, groups, rewards/values dtype, dense rewards)
    "float64": (torch.float64, GROUPS, torch.float64, False),
    "int64_groups_of_one": (torch.int64, GROUPS_WITH_SINGLES, torch.float64, False),
    "bf16_int64": (torch.int64, GROUPS_WITH_SINGLES, torch.bfloat16, False),
    "bf16_dense_int64": (torch.int64, GROUPS, torch.bfloat16, True),
}


def outputs(rewards, values, mask, uids) -> dict:
    config = SimpleNamespace(gamma=0.9)
    runs = {
        "reinforce_plus_plus": lambda: verl.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=config),
        "gae": lambda: verl.compute_gae_advantage_return(rewards, values, mask, 0.95, 0.9),
        "grpo": lambda: verl.compute_grpo_outcome_advantage(rewards, mask, uids, 1e-6, True),
        "grpo_no_std": lambda: verl.compute_grpo_outcome_advantage(rewards, mask, uids, 1e-6, False),
        "rloo": lambda: verl.compute_rloo_outcome_advantage(rewards, mask, uids),
        "reinforce_plus_plus_baseline": lambda: verl.compute_reinforce_plus_plus_baseline_outcome_advantage(
            rewards, mask, uids),
    }
    found = {}
    for name, run in runs.items():
        advantages, returns = run()
        found[name] = {"advantages": advantages.double().tolist(), "returns": returns.double().tolist(),
                       "dtype": str(advantages.dtype)}
    return found


def main() -> None:
    torch.set_num_threads(1)
    found = {}
    for case, (mask_dtype, groups, dtype, dense) in CASES.items():
        found[case] = []
        for seed in range(3):
            rewards, values, mask, uids, *_ = multi_turn_batch(seed, mask_dtype, groups)
            if dense:
                rewards = torch.randn(rewards.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * mask
            rewards, values = rewards.to(dtype), values.to(dtype)
            inputs = {"rewards": rewards.double().tolist(), "values": values.double().tolist(), "mask": mask.tolist(),
                      "uids": list(uids)}
            found[case].append({"inputs": inputs, "outputs": outputs(rewards, values, mask, uids)})
    print(json.dumps(found))


if __name__ == "__main__":
    main()
