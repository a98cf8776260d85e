"""The learning side of CERNenv Lab: agents, rollouts, evaluation, evidence, training."""
