"""CUDA runtime helpers shared by the GPU sampler and the feature gather: stream handles, pinned
host regions mapped into the GPU, and the one NVRTC compile path."""
