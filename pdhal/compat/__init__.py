"""Engines' own call shapes over pdhal, one module per engine (pdhal.compat.fastdeploy)."""
