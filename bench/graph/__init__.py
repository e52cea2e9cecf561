"""Benches of the living graph (docs/architecture.md, "The living graph"): serving under a stream of
graph updates."""
