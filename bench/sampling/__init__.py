"""Samplers: the C++ CPU sampler, the CUDA samplers, the adjacency cache layouts."""
