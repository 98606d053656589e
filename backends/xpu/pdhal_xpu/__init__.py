"""pdhal backend for Kunlunxin XPU (entry point `xpu` in group `pdhal.backends`)."""
