"""verl's own ``ray_trainer.compute_advantage`` with the turn-level estimators (issue 47), in a side environment with
verl, as a TaskRunner runs it (without Ray): ``VERL_USE_EXTERNAL_MODULES=agent_loop.integrations.verl_register``
registers ``agent_loop_<name>`` and wraps ``compute_advantage`` so that they read the batch's token ids and values.
Prints one JSON object: whether the wrapper is in place, the batch, and each estimator's advantages or its error.

    VERL_USE_EXTERNAL_MODULES=agent_loop.integrations.verl_register python turn_level.py
"""

import json

import torch
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo.ray_trainer import compute_advantage

from agent_loop.integrations.verl_comparison import GROUPS_WITH_SINGLES, multi_turn_batch

NAMES = ("turn_returns", "turn_rloo", "turn_index_normalized", "gigpo", "turn_gae")
RESPONSE_TOKEN = 7  # every response token's id: each row's 3-token observation is the same anchor state


def main() -> None:
    rewards, values, mask, uids, *_ = multi_turn_batch(0, torch.int64, GROUPS_WITH_SINGLES)
    responses = torch.full(mask.shape, RESPONSE_TOKEN, dtype=torch.long)
    out = {"wrapped": bool(getattr(compute_advantage, "agent_loop_captures", False)), "outputs": {},
           "batch": {"rewards": rewards.tolist(), "values": values.tolist(), "mask": mask.tolist(), "uids": list(uids)}}
    for name in NAMES:
        estimator = f"agent_loop_{name}"
        data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "values": values, "response_mask": mask,
                                            "responses": responses}, non_tensors={"uid": uids})
        try:
            result = compute_advantage(data, estimator, gamma=0.9, lam=0.95,
                                       config=AlgoConfig(gamma=0.9, lam=0.95, adv_estimator=estimator))
            out["outputs"][name] = result.batch["advantages"].tolist()
        except Exception as error:
            out["outputs"][name] = {"error": f"{type(error).__name__}: {error}"}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
