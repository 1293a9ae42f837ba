"""The programs suite: randomized request programs per cell (the engine is conformance/programs)."""
