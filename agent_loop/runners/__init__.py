"""Many episodes: what a run is (:mod:`.spec`), the asyncio runner (:mod:`.local`) and the Ray one
(:mod:`.ray_runner`), JSON Lines that survive a kill (:mod:`.jsonl`), the one summary (:mod:`.stats`)
and trajectories to batch tensors (:mod:`.batch`). docs/design.md section 6."""
