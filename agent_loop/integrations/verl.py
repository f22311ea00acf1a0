"""verl plugin: our carry-through REINFORCE++ and GAE in verl's advantage-estimator registry, and
spans from a verl batch (docs/verl.md).

    import agent_loop.integrations.verl as agent_loop_verl
    agent_loop_verl.register()  # before verl builds its trainer, e.g. at the top of your main
    # then: algorithm.adv_estimator=agent_loop_reinforce_plus_plus

verl is imported only inside :func:`register` (``pip install agent-loop[verl]``); the rest needs
torch only. Both estimators run the loop-free scans (the fused Triton kernels on CUDA) instead of
verl's Python loop over tokens, with the same values (verl after PR #7300 / #2337).
"""

import torch

from advantages import gae, reinforce_plus_plus
from agent_loop.integrations.spans import spans_from_masks

REINFORCE_PLUS_PLUS = "agent_loop_reinforce_plus_plus"
GAE = "agent_loop_gae"


def reinforce_plus_plus_for_verl(token_level_rewards, response_mask, config=None, **verl_kwargs):
    """verl's estimator call (``fn(token_level_rewards=, response_mask=, config=, index=, ...)``) ->
    carry-through REINFORCE++ with ``gamma = config.gamma`` (verl's ``AlgoConfig``; 1.0 without one).

    ``verl_kwargs`` are the optional batch fields verl's ``compute_advantage`` passes to every
    registered estimator (``index``, ``reward_baselines``, ...); REINFORCE++ uses none of them, as
    verl's own ``compute_reinforce_plus_plus_outcome_advantage``. Returns ``(advantages, returns)``.
    """
    gamma = 1.0 if config is None else float(config.gamma)
    with torch.no_grad():
        return reinforce_plus_plus(token_level_rewards, response_mask, gamma)


def gae_for_verl(token_level_rewards, response_mask, config=None, values=None, **verl_kwargs):
    """verl's estimator call -> carry-through GAE with ``config.gamma`` and ``config.lam``.

    verl 0.9's ``compute_advantage`` passes ``values`` only to its built-in ``gae``; under this
    registry name it raises ValueError unless the caller passes ``values``. To run verl's own ``gae``
    path on these scans instead, use ``register(replace_builtin_gae=True)``.
    """
    if values is None:
        raise ValueError(
            f"{GAE} needs values=(b, t) critic values, which verl's compute_advantage passes only to its built-in "
            "'gae'; call agent_loop.integrations.verl.register(replace_builtin_gae=True) and keep adv_estimator=gae"
        )
    gamma, lam = (1.0, 1.0) if config is None else (float(config.gamma), float(config.lam))
    return compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam)


def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    """Drop-in for verl's ``core_algos.compute_gae_advantage_return`` (same arguments and values on
    ASSISTANT tokens; ``returns`` are 0 off them, where verl leaves carried values its losses mask)."""
    with torch.no_grad():
        return gae(token_level_rewards, values, response_mask, float(gamma), float(lam))


def register(replace_builtin_gae: bool = False) -> list[str]:
    """Add :data:`REINFORCE_PLUS_PLUS` and :data:`GAE` to verl's estimator registry; returns the names.

    ``replace_builtin_gae``: also point ``verl.trainer.ppo.core_algos.compute_gae_advantage_return``
    (which verl's trainer calls for ``adv_estimator=gae``) at :func:`compute_gae_advantage_return`.
    Registering twice is a no-op. ImportError (naming the extra) if verl is not installed.
    """
    try:
        from verl.trainer.ppo import core_algos
    except ImportError as error:
        raise ImportError("the verl plugin needs verl: pip install 'agent-loop[verl]'") from error
    core_algos.register_adv_est(REINFORCE_PLUS_PLUS)(reinforce_plus_plus_for_verl)
    core_algos.register_adv_est(GAE)(gae_for_verl)
    if replace_builtin_gae:
        core_algos.compute_gae_advantage_return = compute_gae_advantage_return
    return [REINFORCE_PLUS_PLUS, GAE]


def spans_from_verl_batch(
    responses: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Spans ``(b, t)`` of a verl batch: PAD where the response part of ``attention_mask`` is 0,
    ASSISTANT where ``response_mask`` is 1, OBSERVATION for its other zeros (tool results in verl's
    multi-turn agent loop).

    ``responses`` ``(b, t)`` token ids (right-padded), ``attention_mask`` ``(b, prompt + t)`` (the
    last ``t`` columns are the response), ``response_mask`` ``(b, t)``. ValueError (row and position)
    for a response-mask 1 on padding or padding before a token.
    """
    t = responses.shape[-1]
    if attention_mask.dim() != 2 or attention_mask.shape[0] != responses.shape[0] or attention_mask.shape[1] < t:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} must be (b, prompt + t) for responses {tuple(responses.shape)}"
        )
    return spans_from_masks(attention_mask[:, -t:], response_mask)
