"""Mutation suites: planted bugs (in the composition, and in production's real code) the gate must catch."""
