"""Training: optimizers, LR schedules, precision policy, MoE load balancing and the training loop."""
