"""kmix.tags.crc32c against an independent reference: TensorBoard's byte-by-byte CRC-32C."""

from __future__ import annotations

import numpy as np
import pytest
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c as reference_crc
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import (
    masked_crc32c as reference_masked,
)

from kmix.tags.crc32c import BLOCK, crc32c, masked_crc32c


def test_the_standard_check_value():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0


LENGTHS = [*range(0, 40), BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 3 * BLOCK + 17, 70_001]


@pytest.mark.parametrize("length", LENGTHS)
def test_equals_tensorboards_crc_at_every_length_around_a_block(length):
    data = np.random.default_rng(length).integers(0, 256, length, dtype=np.uint8).tobytes()
    assert crc32c(data) == reference_crc(data)
    assert masked_crc32c(data) == reference_masked(data)


def test_runs_of_one_byte_value_equal_the_reference():
    for value in (0x00, 0xFF, 0x80):
        data = bytes([value]) * (5 * BLOCK + 3)
        assert masked_crc32c(data) == reference_masked(data)
