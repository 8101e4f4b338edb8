"""Shared test fixtures: every test starts and ends with Keras's default state."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_keras_state():
    """Restore the global dtype policy and clear Keras's session after each test."""
    policy = keras.config.dtype_policy()
    yield
    keras.config.set_dtype_policy(policy)
    keras.utils.clear_session()
