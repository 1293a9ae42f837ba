"""The matrix and its records: cells, axes, strategies, grids, faults."""
