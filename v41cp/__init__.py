"""v41cp: DeepSeek-V4.1 inference in JAX with context parallelism over attention TP."""

__version__ = "0.1.0"
