"""dsv4-parity: parity."""
