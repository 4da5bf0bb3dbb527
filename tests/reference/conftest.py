"""Reference tests run single-threaded: their tensors are tiny, and with ``-n 2`` workers on 2 cores every
multi-threaded op (mm, softmax) otherwise waits on an oversubscribed OpenMP barrier (measured ~20x slower)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
