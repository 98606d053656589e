"""A test-only plugin whose import fails, as a plugin with a missing dependency would."""

raise ImportError("libvendor.so.9: cannot open shared object file (test plugin)")
