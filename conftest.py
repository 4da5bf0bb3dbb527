"""Project-wide pytest configuration (root conftest: the repository root is importable, torch is deterministic)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
torch.use_deterministic_algorithms(True, warn_only=True)
