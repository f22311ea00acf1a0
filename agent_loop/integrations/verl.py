"""verl plugin: our carry-through REINFORCE++ and GAE in verl's advantage-estimator registry, and
spans from a verl batch (docs/verl.md).

    import agent_loop.integrations.verl as agent_loop_verl
    agent_loop_verl.register()  # before verl builds its trainer, e.g. at the top of your main
    # then: algorithm.adv_estimator=agent_loop_reinforce_plus_plus

verl is imported only inside :func:`register` (``pip install agent-loop[verl]``); the rest needs
torch only. Both estimators run the loop-free scans (the fused Triton kernels on CUDA) instead of
verl's Python loop over tokens, with the same values (verl after PR #7300 / #2337).

**Rewards on observation tokens.** A custom verl agent loop whose trajectory ends in a tool output
puts the reward on an OBSERVATION token (a 0 of ``response_mask``); verl's REINFORCE++ and GAE loops
then drop it silently. The plugin does the same by default (``observation_reward="drop"``), or moves
it to the last ASSISTANT token before it (``"move"``), or raises (``"raise"``):
:func:`masking.rewards.relocate_observation_rewards`. verl's estimators cannot return metrics, so
every call that moves or drops rewards logs their number (one ``logging`` warning on the
``agent_loop.integrations.verl`` logger), and :func:`observation_reward_count` returns the total of
this process, for an AgentLoop or trainer to report. Reading the count costs one host sync per call
(the validation the plugin runs costs one already).
"""

import contextvars
import dataclasses
import functools
import logging
import os
import sys

import torch

from advantages import TURN_LEVEL, gae, get_estimator, reinforce_plus_plus  # TURN_LEVEL: registered as agent_loop_*
from agent_loop.episode.contracts import state_key
from agent_loop.integrations.spans import spans_from_masks
from masking.rewards import OBSERVATION_REWARD_POLICIES, relocate_observation_rewards
from masking.spans import SpanKind, spans_from_response_mask

REINFORCE_PLUS_PLUS = "agent_loop_reinforce_plus_plus"
GAE = "agent_loop_gae"
OBSERVATION_REWARD_ENV = "AGENT_LOOP_VERL_OBSERVATION_REWARD"  # register()'s default, for processes that register on import
DEFAULT_OBSERVATION_REWARD = "drop"  # what verl's own loops do

logger = logging.getLogger(__name__)
_settings: dict[str, str | None] = {"observation_reward": None}  # set by register()
_seen = {"observation_rewards": 0}


def observation_reward_count() -> int:
    """How many rewards on observation tokens the plugin's estimators moved or dropped in this process."""
    return _seen["observation_rewards"]


def _observation_policy(observation_reward: str | None) -> str:
    """The policy to use: the argument, else ``$AGENT_LOOP_VERL_OBSERVATION_REWARD``, else "drop";
    ValueError for an unknown one."""
    policy = observation_reward or os.environ.get(OBSERVATION_REWARD_ENV) or DEFAULT_OBSERVATION_REWARD
    if policy not in OBSERVATION_REWARD_POLICIES:
        raise ValueError(f"observation_reward must be one of {OBSERVATION_REWARD_POLICIES}, got {policy!r}")
    return policy


def _place_observation_rewards(token_level_rewards, response_mask, name: str, observation_reward: str | None):
    """The rewards after the observation-reward policy (every 0 of the mask is an observation, as in verl);
    logs and counts what was moved or dropped."""
    policy = _observation_policy(observation_reward or _settings["observation_reward"])
    rewards, count = relocate_observation_rewards(token_level_rewards, spans_from_response_mask(response_mask), policy)
    moved = int(count)  # one host sync; verl's estimators cannot return metrics
    if moved:
        _seen["observation_rewards"] += moved
        action = "moved to the last assistant token before them" if policy == "move" else "dropped, as verl does"
        logger.warning("%s: %d reward(s) on observation tokens %s (observation_reward=%r)", name, moved, action, policy)
    return rewards


def reinforce_plus_plus_for_verl(
    token_level_rewards, response_mask, config=None, *, observation_reward: str | None = None, **verl_kwargs
):
    """verl's estimator call (``fn(token_level_rewards=, response_mask=, config=, index=, ...)``) ->
    carry-through REINFORCE++ with ``gamma = config.gamma`` (verl's ``AlgoConfig``; 1.0 without one).

    ``(b, t)`` rewards and mask -> ``(advantages, returns)`` ``(b, t)``. ``verl_kwargs`` are the
    optional batch fields verl's ``compute_advantage`` passes to every registered estimator
    (``index``, ``reward_baselines``, ...); REINFORCE++ uses none of them, as verl's own
    ``compute_reinforce_plus_plus_outcome_advantage``. Rewards on observation tokens follow
    ``observation_reward`` (default: the one given to :func:`register`; module docstring); the
    batch is then validated (ValueError, as verl's whitening, for fewer than 2 assistant tokens).
    """
    gamma = 1.0 if config is None else float(config.gamma)
    with torch.no_grad():
        rewards = _place_observation_rewards(token_level_rewards, response_mask, REINFORCE_PLUS_PLUS, observation_reward)
        return reinforce_plus_plus(rewards, response_mask, gamma)


def gae_for_verl(
    token_level_rewards, response_mask, config=None, values=None, *, observation_reward: str | None = None, **verl_kwargs
):
    """verl's estimator call -> carry-through GAE with ``config.gamma`` and ``config.lam``.

    verl 0.9's ``compute_advantage`` passes ``values`` only to its built-in ``gae``; under this
    registry name it raises ValueError unless the caller passes ``values``. To run verl's own ``gae``
    path on these scans instead, use ``register(replace_builtin_gae=True)``. Rewards on observation
    tokens as in :func:`reinforce_plus_plus_for_verl`.
    """
    if values is None:
        raise ValueError(
            f"{GAE} needs values=(b, t) critic values, which verl's compute_advantage passes only to its built-in "
            "'gae'; call agent_loop.integrations.verl.register(replace_builtin_gae=True) and keep adv_estimator=gae"
        )
    gamma, lam = (1.0, 1.0) if config is None else (float(config.gamma), float(config.lam))
    return _carry_through_gae(token_level_rewards, values, response_mask, gamma, lam, GAE, observation_reward)


def compute_gae_advantage_return(
    token_level_rewards, values, response_mask, gamma, lam, *, observation_reward: str | None = None
):
    """Drop-in for verl's ``core_algos.compute_gae_advantage_return`` (same arguments and values on
    ASSISTANT tokens; ``returns`` are 0 off them, where verl leaves carried values its losses mask).
    Rewards on observation tokens as in :func:`reinforce_plus_plus_for_verl`."""
    return _carry_through_gae(token_level_rewards, values, response_mask, gamma, lam, "gae", observation_reward)


def _carry_through_gae(token_level_rewards, values, response_mask, gamma, lam, name: str, observation_reward):
    with torch.no_grad():
        rewards = _place_observation_rewards(token_level_rewards, response_mask, name, observation_reward)
        return gae(rewards, values, response_mask, float(gamma), float(lam))


# --- the turn-level estimators (advantages/turn_credit.py, issue 47) ------------------------------------

_current_batch: contextvars.ContextVar = contextvars.ContextVar("agent_loop_verl_batch", default=None)


def _batch_fields(data, b: int) -> dict:
    """What verl's batch (``DataProto``, captured by :func:`capture_batches`) holds for the turn-level estimators:
    ``responses``, ``attention_mask`` and ``values`` tensors, and ``turn_states`` (our AgentLoop's
    ``agent_loop_info`` column, when every row records them)."""
    if data is None:
        return {}
    tensors = data.batch
    fields = {name: tensors[name] for name in ("responses", "attention_mask", "values") if name in tensors.keys()}
    infos = data.non_tensor_batch.get("agent_loop_info") if data.non_tensor_batch is not None else None
    if infos is not None and len(infos) == b:
        states = [info.get("turn_states") if isinstance(info, dict) else None for info in infos]
        if all(isinstance(row, list) for row in states):
            fields["turn_states"] = states
    return fields


def _states_within(turn_states: list, spans: torch.Tensor) -> list:
    """Each row's keys, hashable (lists as tuples), cut to the turns its response kept (verl cuts a response at
    ``response_length``: the keys of turns cut off go)."""
    assistant = spans == SpanKind.ASSISTANT
    starts = assistant & ~torch.nn.functional.pad(assistant, (1, 0))[:, :-1]
    turns = starts.sum(dim=1).tolist()  # host: the keys are host objects anyway
    return [[state_key(key) for key in keys[:n]] for keys, n in zip(turn_states, turns)]


def settings_in(config, settings) -> dict:
    """What verl's ``config`` (its ``AlgoConfig``, or None) sets of the estimator's ``settings`` dataclass
    (``advantages.settings``: ``gamma``, ``lam``, ``step_advantage_w``, ``gigpo_mode``), as keywords; the
    settings it lacks (or sets to None) keep the estimator function's own defaults."""
    if config is None or settings is None:
        return {}
    values = {setting.name: getattr(config, setting.name, None) for setting in dataclasses.fields(settings)}
    return {name: value for name, value in values.items() if value is not None}


def turn_level_for_verl(name: str):
    """verl's estimator call -> ``advantages.<name>`` (one of :data:`TURN_LEVEL`) on the batch our AgentLoop
    builds: ``response_mask`` is 1 on ASSISTANT tokens, 0 on tool results and padding; the spans tell them
    apart by ``attention_mask`` (PAD where it is 0), the turns are the ASSISTANT runs; ``index`` is verl's
    ``uid``; the estimator's settings come from ``config`` (verl's ``AlgoConfig``) where it has them
    (:func:`settings_in`). verl's ``compute_advantage`` passes only the rewards, the mask, the
    config and the uids: the rest (``responses``: gigpo's anchor states are the tool results' tokens;
    ``attention_mask``; ``values`` for turn_gae; ``turn_states`` a task records, in ``agent_loop_info``) is read
    from the batch that ``compute_advantage`` is computing (:func:`capture_batches`), or given as keywords."""
    entry = get_estimator(name)

    def estimator(token_level_rewards, response_mask, config=None, index=None, values=None, *, responses=None,
                  attention_mask=None, turn_states=None, observation_reward: str | None = None, **verl_kwargs):
        b = token_level_rewards.shape[0]
        given = {"responses": responses, "attention_mask": attention_mask, "values": values, "turn_states": turn_states}
        fields = {**_batch_fields(_current_batch.get(), b), **{k: v for k, v in given.items() if v is not None}}
        with torch.no_grad():
            rewards = _place_observation_rewards(token_level_rewards, response_mask, f"agent_loop_{name}",
                                                 observation_reward)
            mask = fields.get("attention_mask")
            spans = (spans_from_verl_batch(fields.get("responses", response_mask), mask, response_mask)
                     if mask is not None else spans_from_response_mask(response_mask))
            if "turn_states" in fields and not isinstance(fields["turn_states"], torch.Tensor):
                fields["turn_states"] = _states_within(fields["turn_states"], spans)
            batch = {"spans": spans, "index": index, **fields}
            settings = settings_in(config, entry.settings)
            kwargs = {key: batch[key] for key in entry.batch_arguments if batch.get(key) is not None}
            if name == "gigpo" and "responses" not in kwargs and "turn_states" not in kwargs:
                raise ValueError("agent_loop_gigpo needs the batch's responses (its anchor states are the tool "
                                 "results' tokens): register() lets verl's compute_advantage hand them over "
                                 "(verl.trainer.ppo.ray_trainer), or pass responses=(b, t) token ids")
            return entry(rewards, response_mask, **kwargs, **settings)

    estimator.__name__ = estimator.__qualname__ = f"agent_loop_{name}_for_verl"
    estimator.__doc__ = f"``agent_loop_{name}``: :func:`turn_level_for_verl` of ``{name}``."
    return estimator


TURN_LEVEL_FOR_VERL = {f"agent_loop_{name}": turn_level_for_verl(name) for name in TURN_LEVEL}


def capture_batches(ray_trainer) -> None:
    """Wrap verl's ``ray_trainer.compute_advantage`` so that the batch it computes is readable by the turn-level
    estimators (:data:`TURN_LEVEL_FOR_VERL`) while it runs (a context variable; nothing else changes). verl's
    trainer calls it by its module name, so the wrapper is what it calls. Wrapping twice is a no-op."""
    original = ray_trainer.compute_advantage
    if getattr(original, "agent_loop_captures", False):
        return

    @functools.wraps(original)
    def compute_advantage(data, *args, **kwargs):
        token = _current_batch.set(data)
        try:
            return original(data, *args, **kwargs)
        finally:
            _current_batch.reset(token)

    compute_advantage.agent_loop_captures = True
    ray_trainer.compute_advantage = compute_advantage


def register(replace_builtin_gae: bool = False, *, observation_reward: str | None = None) -> list[str]:
    """Add :data:`REINFORCE_PLUS_PLUS`, :data:`GAE` and the turn-level ``agent_loop_turn_returns``,
    ``agent_loop_turn_rloo``, ``agent_loop_turn_index_normalized``, ``agent_loop_gigpo`` and
    ``agent_loop_turn_gae`` (:func:`turn_level_for_verl`) to verl's estimator registry; returns the names.

    ``replace_builtin_gae``: also point ``verl.trainer.ppo.core_algos.compute_gae_advantage_return``
    (which verl's trainer calls for ``adv_estimator=gae``) at :func:`compute_gae_advantage_return`.
    ``observation_reward``: "drop" (verl's behaviour), "move" or "raise" for rewards on observation
    tokens (module docstring); None reads ``$AGENT_LOOP_VERL_OBSERVATION_REWARD`` (so a process that
    registers on import can be configured), else "drop". Checked before verl is touched (ValueError).
    Registering twice is a no-op, but each call sets the policy. ImportError (naming the extra) if
    verl is not installed.
    """
    policy = _observation_policy(observation_reward)
    try:
        from verl.trainer.ppo import core_algos
    except ImportError as error:
        raise ImportError("the verl plugin needs verl: pip install 'agent-loop[verl]'") from error
    _settings["observation_reward"] = policy
    core_algos.register_adv_est(REINFORCE_PLUS_PLUS)(reinforce_plus_plus_for_verl)
    core_algos.register_adv_est(GAE)(gae_for_verl)
    for name, fn in TURN_LEVEL_FOR_VERL.items():
        core_algos.register_adv_est(name)(fn)
    if replace_builtin_gae:
        core_algos.compute_gae_advantage_return = compute_gae_advantage_return
    if "verl.trainer.ppo.ray_trainer" in sys.modules:  # else verl_register wraps it once it is imported
        capture_batches(sys.modules["verl.trainer.ppo.ray_trainer"])
    return [REINFORCE_PLUS_PLUS, GAE, *TURN_LEVEL_FOR_VERL]


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
