"""Fixtures shared by the server and failure tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def hosts_checkpoint(tmp_path_factory):
    """A tiny checkpoint and its greedy oracle tokens (:func:`~tests.support.hosts_serving.checkpoint_and_oracle`) for
    the simulated-hosts serving tests, built once per module."""
    from tests.support.hosts_serving import checkpoint_and_oracle  # (only these tests need its imports)

    return checkpoint_and_oracle(str(tmp_path_factory.mktemp("ckpt") / "ckpt"))
