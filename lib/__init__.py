"""The learning side of CERNenv Lab, in floors that import only downwards (docs/layout.md):
plumbing here (files, progress, extras, runtime, gpu_set), then agents, episodes, measure,
report, training and notebooks."""
