"""The UVA sampler's GPU cache of the hottest neighbour lists: packed and Elias-Fano layouts, their bit helpers, and the CPU twin of what the kernel reads over the bus."""
