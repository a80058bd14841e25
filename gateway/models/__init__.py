"""Models: the models.yaml registry, resident engines and their worker processes, conversions."""
