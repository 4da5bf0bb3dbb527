"""A CPU-testable count of the host reads a piece of harness code makes (on CUDA each one is a device sync):
:class:`bench.ops.HostReads`, which the bench's ``ops`` section also reports per engine phase."""

from __future__ import annotations

from bench.ops import HostReads

__all__ = ["HostReads"]
