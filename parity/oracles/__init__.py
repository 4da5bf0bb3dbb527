"""Metamorphic oracles: one implementation against itself under a transformation that must not matter."""
