"""Fixtures shared by the DeepSpeed tests that build an engine in this one process."""
from __future__ import annotations

import os

import pytest

from dist_nce.cluster.runtime import single_process_dist_env


@pytest.fixture(scope="module")
def dist_env():
    """torch.distributed env vars for a single process outside a launcher, restored afterwards."""
    saved = {k: os.environ.get(k) for k in single_process_dist_env(0)}
    os.environ.update(single_process_dist_env())
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
