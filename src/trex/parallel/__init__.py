"""Parallelism applied to an unchanged model: device mesh, FSDP2, expert parallel, activation
checkpointing, and the pre-flight check that every rank will run the same collectives."""
