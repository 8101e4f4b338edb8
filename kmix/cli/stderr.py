"""TensorFlow's start-up log lines, dropped from stderr by the ``kmix`` commands.

TensorFlow's start-up lines ("Could not find cuda drivers", "failed call to cuInit",
oneDNN notes) are not what the user asked for: the commands that import TensorFlow drop
those known lines from stderr and pass every other line through
(:func:`quiet_tensorflow_startup`). ``TF_CPP_MIN_LOG_LEVEL=0 kmix ...`` shows them.

A leaf of the ``kmix`` command: standard library only, so ``kmix --help`` stays light.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator

STARTUP_NOISE = (
    "All log messages before absl::InitializeLog() is called are written to STDERR",
    "oneDNN custom operations are on",
    "Could not find cuda drivers on your machine",
    "failed call to cuInit",
    "This TensorFlow binary is optimized to use available CPU instructions",
    "To enable the following instructions:",
    "oneDNN supports DT_HALF only on platforms with AVX-512",
    "Unable to register cuDNN factory",
    "Unable to register cuFFT factory",
    "Unable to register cuBLAS factory",
    "computation placer already registered",
    "TF-TRT Warning: Could not find TensorRT",
    "successful NUMA node read from SysFS had negative value",
)
"""Phrases of the lines TensorFlow logs at start-up that say nothing about the command."""

_LOG_PREFIX = re.compile(r"^(WARNING: |[IWE]\d{4} [\d:.]+ +\d+ [\w.]+:\d+\] |To enable )")


def is_startup_noise(line: str) -> bool:
    """Whether a stderr line is one of TensorFlow's known start-up log lines.

    Only lines in TensorFlow's (absl's) log format, or the line that continues its
    CPU-instructions note, that contain a phrase of :data:`STARTUP_NOISE` are noise;
    every other line (a traceback, a warning, a real error) is not.

    Args:
        line: one line of stderr, with or without its newline.

    Returns:
        True if the line should not be shown.
    """
    return bool(_LOG_PREFIX.match(line)) and any(phrase in line for phrase in STARTUP_NOISE)


@contextlib.contextmanager
def quiet_tensorflow_startup() -> Iterator[None]:
    """Drops TensorFlow's start-up log lines from this process's stderr, keeps the rest.

    TensorFlow's C++ side writes them to file descriptor 2 before its log levels
    apply, so ``TF_CPP_MIN_LOG_LEVEL`` cannot hide them all. Inside the block, file
    descriptor 2 is a pipe read by a thread that forwards each line to the real stderr
    unless :func:`is_startup_noise` says it is start-up noise. ``TF_CPP_MIN_LOG_LEVEL``
    is set to 2 (no info or warning lines) unless the user set it.

    Yields:
        Nothing; stderr is restored when the block ends.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    try:
        real = os.dup(2)
    except OSError:  # no stderr at all: nothing to keep quiet
        yield
        return
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def forward() -> None:
        with open(read_end, "rb", closefd=True) as pipe:
            for line in pipe:
                try:
                    keep = not is_startup_noise(line.decode("utf-8", "replace"))
                except Exception:  # never lose a line to a bug here
                    keep = True
                if keep:
                    _write_all(real, line)

    thread = threading.Thread(target=forward, name="kmix-stderr", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)  # closes the pipe's last write end: the thread reads to the end
        thread.join(timeout=10)
        os.close(real)


def _write_all(fd: int, data: bytes) -> None:
    """Writes all of ``data`` to the file descriptor ``fd`` (``os.write`` may write less)."""
    while data:
        data = data[os.write(fd, data) :]
