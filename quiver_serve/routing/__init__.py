"""Routing (docs/architecture.md, "Routing"): which path samples a batch. The router, the per-path
cost model, PSGS and the start-up calibration."""
