"""Pipeline stages: batcher, router, hybrid sampler, inference server, and the facade."""
