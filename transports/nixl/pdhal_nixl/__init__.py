"""pdhal-nixl: the `nixl` transport of pdhal.transfer (NVIDIA NIXL, its UCX backend)."""
