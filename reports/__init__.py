"""dsv4-parity: reports."""
