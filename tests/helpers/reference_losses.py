"""Plain serial reference of verl's dual-clip PPO term for one token (Python floats), shared by the tests that
check a loss token by token: ``from reference_losses import ppo_token_loss``."""


def ppo_token_loss(ratio: float, advantage: float, low: float = 0.2, high: float = 0.2, clip_c: float = 3.0) -> float:
    """``max(-A r, -A clip(r, 1 - low, 1 + high))``, capped at ``-A c`` where ``A < 0`` (the dual clip,
    ``clip_ratio_c`` 3 by default as in ``advantages.ppo_clip_policy_loss`` and verl)."""
    loss = max(-advantage * ratio, -advantage * min(max(ratio, 1 - low), 1 + high))
    return min(loss, -advantage * clip_c) if advantage < 0 else loss
