"""Suite-wide settings."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    """The tests use tiny tensors: one intra-op thread avoids OpenMP start-up and spin costs, which on a 2-core
    machine shared with other processes make small ops 10-20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
