"""Routing modes: the engine core driven directly and the real daemon."""
