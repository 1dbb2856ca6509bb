"""Training: the state of a run, the loop, checkpoints and resume, the loss, callbacks."""
