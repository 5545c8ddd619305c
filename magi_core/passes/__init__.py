"""FX passes that make a graph traced on the host run on the accelerator, and split it into offload units."""
