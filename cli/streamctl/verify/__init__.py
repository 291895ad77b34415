"""`streamctl verify-index` as a library: a checkpoint's index, headers and sharded state, checked from headers."""
