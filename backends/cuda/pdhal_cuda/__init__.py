"""pdhal backend for NVIDIA CUDA (entry point `cuda` in group `pdhal.backends`)."""
