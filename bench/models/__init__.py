"""Benches of the model repository (DESIGN §9): a new model version loaded while the daemon serves."""
