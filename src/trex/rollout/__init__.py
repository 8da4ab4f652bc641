"""Generation inside trex: batched sampling from the live (plain or sharded) model."""

from trex.rollout.sampling import Samples, SamplingParams, sample

__all__ = ["SamplingParams", "Samples", "sample"]
