"""Execution: running a per-rank program (LocalModule, the sharded optimizer), pipeline schedules, saved state (distributed checkpoints), gradient clipping, inputs and the timeline."""
