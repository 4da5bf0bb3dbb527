"""Judging tensors: snapshots of a run, metrics, the structural and layered numeric rules, top-k ties."""
