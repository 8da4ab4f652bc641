"""The one error type of checkpoint I/O."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written; the message names the file and tensor."""
