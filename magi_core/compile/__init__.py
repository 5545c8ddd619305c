"""Compiling a model for offload: the magi_offload Dynamo backend, its warm-up lifecycle, device inputs."""
