"""Benches of the model repository (docs/architecture.md, "Models and versions"): a new model
version loaded while the daemon serves."""
