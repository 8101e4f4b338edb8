"""Shared test fixtures: every test starts and ends with Keras's default state.

Both tiers (``-m "not slow"`` and everything) need what is here:

- TensorFlow's oneDNN CPU kernels are off unless the caller chose (set before
  TensorFlow is first imported; the subprocess tests inherit it): on Xeons with
  AVX512_FP16 oneDNN's float16 kernels were reported far slower than TensorFlow's own
  (not measured here: the 2-core test machine is an AMD EPYC without AVX512_FP16).
- ``keras.utils.clear_session()`` after each test runs a full garbage collection; with
  TensorFlow loaded that walks some 300,000 objects (0.3-0.7 s a test, more than most
  tests take). What exists once the tests are collected (modules, TensorFlow's
  registries) is never garbage, so it is moved out of the collector's sight with
  ``gc.freeze()``; each test's own garbage is still collected after it. What survives a
  test (modules it imported: JAX, Playwright, TensorBoard; TensorFlow's graphs and caches)
  is frozen too, right after that collection, or every later test's collection walks it
  again (late in the suite pure tests took ~2 s in teardown).

The same tests also run on Keras's JAX and torch backends, a second and a third pass:
``KERAS_BACKEND=jax python -m pytest -q -m jax`` and ``KERAS_BACKEND=torch python -m
pytest -q -m torch``. Only the tests marked with the backend's name apply there (the
behaviour tests: scale rule, skip bit-for-bit, events, health, forward origin, monitor
files, guard trips, save/load); the others use TensorFlow directly or cover what is
TensorFlow only (tf.distribute), and on those backends they are skipped even without
``-m``. Nothing here imports TensorFlow; the oneDNN variable only matters where
TensorFlow is loaded.
"""

from __future__ import annotations

import gc
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

# The tests mirror kmix's folders (tests/<folder>/test_<module>.py); a test module may
# import helpers from another folder's (``from test_report import hand_log``), so every
# folder is on the path, as pytest puts each test file's own.
_TESTS = pathlib.Path(__file__).resolve().parent
sys.path[1:1] = [
    str(p)
    for p in sorted(_TESTS.iterdir())
    if p.is_dir() and p.name not in ("data", "scripts", "__pycache__")
]

import keras  # noqa: E402
import pytest  # noqa: E402

BACKEND = keras.backend.backend()
JAX = BACKEND == "jax"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On another backend than TensorFlow, skip what is not marked with its name (``jax``,
    ``torch``): it applies to TensorFlow only."""
    if BACKEND == "tensorflow":
        return
    skip = pytest.mark.skip(reason=f"not marked {BACKEND}: runs with the TensorFlow backend only")
    for item in items:
        if item.get_closest_marker(BACKEND) is None:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _freeze_what_exists_before_the_tests():
    """Collects once, then keeps the import-time objects out of every later collection."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _restore_keras_state():
    """Restore the global dtype policy and clear Keras's session after each test."""
    policy = keras.config.dtype_policy()
    yield
    keras.config.set_dtype_policy(policy)
    keras.utils.clear_session()  # collects this test's garbage
    gc.freeze()  # what survived it is not garbage for the tests after
