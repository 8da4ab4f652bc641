"""`trex report`: one portability report (Markdown and a self-contained HTML page) from the files
`trex audit`, `trex doctor`, `trex fidelity` and `trex plan` write."""
