"""The replay engine: operator resolution, argument materialization, the op loop, memory."""
