"""Copy-engine communication (``Schedule(comm="dma")``) through the ficco XLA FFI."""
