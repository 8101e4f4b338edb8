"""CRC-32C (Castagnoli) for TFRecord framing, in NumPy: kmix's event files without TensorFlow.

TensorBoard's pure-Python ``masked_crc32c`` loops over every byte (about 8 MB/s); a
monitor read that writes a histogram per variable of a large model frames a megabyte.
The CRC is linear over GF(2), so a block of ``BLOCK`` bytes is folded in at once::

    register after a block = shift(register) ^ XOR_j contribution[j][byte_j]

where ``contribution[j][v]`` is byte value ``v`` at block position ``j`` carried to the
block's end, and ``shift`` is ``BLOCK`` zero bytes applied to the register (a linear map
on 32 bits, one table per register byte). NumPy computes every block's XOR at once;
Python folds the blocks in order. Bytes before the first whole block take the byte loop.

Example:
    >>> hex(crc32c(b"123456789"))  # CRC-32C's check value
    '0xe3069283'
"""

from __future__ import annotations

import functools

import numpy as np

POLYNOMIAL = 0x82F63B78
"""CRC-32C's polynomial, bit-reflected."""

BLOCK = 256
"""Bytes folded in per step of the Python loop."""

_MASK_DELTA = 0xA282EAD8  # TFRecord's mask: rotate right by 15, add this


@functools.cache
def _byte_table() -> list[int]:
    """The classic table: one byte through the register from 0."""
    table = []
    for value in range(256):
        crc = value
        for _ in range(8):
            crc = (crc >> 1) ^ (POLYNOMIAL if crc & 1 else 0)
        table.append(crc)
    return table


@functools.cache
def _block_tables() -> tuple[np.ndarray, list[list[int]]]:
    """``(contribution[BLOCK, 256], shift[4][256])`` of the module docstring."""
    table = np.asarray(_byte_table(), dtype=np.uint32)

    def zero_byte(registers: np.ndarray) -> np.ndarray:
        return table[registers & 0xFF] ^ (registers >> 8)

    contribution = np.empty((BLOCK, 256), dtype=np.uint32)
    contribution[BLOCK - 1] = table
    for position in range(BLOCK - 2, -1, -1):
        contribution[position] = zero_byte(contribution[position + 1])
    shifted = (
        np.arange(256, dtype=np.uint32)[None, :] << (8 * np.arange(4, dtype=np.uint32))[:, None]
    )
    for _ in range(BLOCK):
        shifted = zero_byte(shifted)
    return contribution, shifted.tolist()


def crc32c(data: bytes) -> int:
    """The CRC-32C of ``data`` (initial value and final XOR ``0xFFFFFFFF``).

    Args:
        data: the bytes.

    Returns:
        The checksum, an unsigned 32-bit int.
    """
    table = _byte_table()
    head = len(data) % BLOCK
    crc = 0xFFFFFFFF
    for byte in data[:head]:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    if len(data) > head:
        contribution, (s0, s1, s2, s3) = _block_tables()
        blocks = np.frombuffer(data, dtype=np.uint8, offset=head).reshape(-1, BLOCK)
        folded = np.bitwise_xor.reduce(contribution[np.arange(BLOCK), blocks], axis=1)
        for block in folded.tolist():
            crc = (
                s0[crc & 0xFF] ^ s1[(crc >> 8) & 0xFF] ^ s2[(crc >> 16) & 0xFF] ^ s3[crc >> 24]
            ) ^ block
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The masked CRC-32C a TFRecord stores (TensorFlow's ``crc32c::Mask``).

    Args:
        data: the bytes checked.

    Returns:
        The masked checksum, an unsigned 32-bit int.
    """
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF
