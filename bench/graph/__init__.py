"""Benches of the living graph (DESIGN §7): serving under a stream of graph updates."""
