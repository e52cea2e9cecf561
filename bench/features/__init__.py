"""Feature store: placement and gather on one and two GPUs, the daemon with part of the features."""
