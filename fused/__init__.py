"""dsv4-parity: fused."""
