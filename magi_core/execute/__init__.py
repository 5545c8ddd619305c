"""The offload runtime: configuration, schedulers, profiler, executor and the torch.compile backend."""
