"""`trex profile`: where a training step's time goes, by class, measured under torch.profiler on the
recipe's device (trex.profile.run), and what the same ops would cost on a named accelerator
(trex.profile.estimate)."""
