"""dsv4-parity: reference."""
