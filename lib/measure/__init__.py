"""Measuring agents: per-episode metrics with bootstrap intervals, the held-out evaluation
suite, and the before/after comparison of a training run."""
