"""Training: the loop, its recipe, optimizers, LR schedules, MoE load balancing, the run directory,
the fidelity signals it records, and `trex train` (with --dry-run)."""
