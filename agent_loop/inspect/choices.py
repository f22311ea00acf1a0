"""What the views can show, named without loading torch (the command line's choices come from here)."""

from advantages.settings import TURN_LEVEL

# name shown to the user -> how the discounted return treats OBSERVATION tokens
COMPARED = {
    "carry-through": "R carried through observations unchanged (correct)",
    "reset-at-observation": "R reset to 0 at every observation (verl before PR #7300)",
    "ignore-mask": "observations scanned like assistant tokens (mask ignored)",
}


# COMPARED name -> the registered estimator (advantages.registry) whose returns it shows
REGISTERED = {
    "carry-through": "reinforce_plus_plus",
    "reset-at-observation": "reinforce_plus_plus_reset_at_observation",
    "ignore-mask": "reinforce_plus_plus_ignore_mask",
}
LABEL = {registered: name for name, registered in REGISTERED.items()}  # --estimator (a registry name) -> COMPARED name
INFORMATIVE = 3  # episodes the terminal shows by default
TURN_ESTIMATORS = TURN_LEVEL  # a file whose episodes record one of these estimators gets the per-turn view
