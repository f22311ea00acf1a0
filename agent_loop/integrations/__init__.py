"""Bridges to other RL trainers: :mod:`.verl` (a plugin for verl's estimator registry, spans from a
verl batch) and :mod:`.trl` (spans and token rewards from a TRL ``GRPOTrainer`` batch). Import the
submodule you need; neither imports verl or TRL (docs/verl.md)."""
