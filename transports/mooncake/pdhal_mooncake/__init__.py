"""pdhal-mooncake: the `mooncake` transport of pdhal.transfer (Mooncake's transfer engine)."""
