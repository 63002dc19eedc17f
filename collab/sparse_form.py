"""The byte form of a sparse fp16 vector on the all-reduce wire (``collab.compression.SparseFloat16Wire``): pure
functions, exact both ways.

A part is sent as its non-zero values and their positions:

- **values**: where the part's non-zero values take at most 256 distinct fp16 values (a peer's top-k contribution
  takes ``2 * 2**(value_bits - 1)``: signed levels of one scale; a reducer's reply a few per groupmate), as a palette
  of those values and a code of as few bits as the palette needs (2 for 4 values, at most 8); otherwise as fp16;
- **positions**: the gaps between them in Rice codes (the gap's quotient by ``2**k`` in unary, its remainder in
  ``k`` bits, ``k`` chosen per part to make the part shortest): about 8.1 bits per position at 1 % density and 6.6 at
  3 %, within 1 % of the entropy of a random support (a bitmap costs 1 bit per value of the part, 100 bits per
  position at 1 %; int32 indices 32).

Layout, little-endian: ``uint32 form (3) | uint32 count | uint8 code_bits (0: fp16 values) | uint8 k | uint16
palette size | palette (fp16 each) | codes or fp16 values | remainders, k bits each | quotients in unary (ones
closed by a zero)``; codes, remainders and quotients are bit strings, most significant bit first, each padded with
zeros to a byte. The form tag is not 1 or 2 (the index and bitmap forms of earlier versions): a peer of such a
version refuses these parts loudly instead of misreading them. Everything is checked on the way in: a part comes
from a groupmate, who may be hostile.
"""

from __future__ import annotations

import math

import numpy as np

CODED_FORM = 3
HEADER = np.dtype([("form", "<u4"), ("count", "<u4"), ("code_bits", "u1"), ("rice_k", "u1"), ("palette", "<u2")])
MAX_CODE_BITS = 8
MAX_PALETTE = 2**MAX_CODE_BITS
PALETTE_PROBE = 4 * MAX_PALETTE
MAX_RICE_K = 31  # remainders of up to 31 bits: gaps past any part's length (collab.compression.MAX_PART_VALUES)


class MalformedPart(ValueError):
    """A sparse part that this form cannot have produced."""


def encode(values: np.ndarray, shorter_than: int | None = None) -> bytes | None:
    """The coded form of the fp16 vector ``values`` (zeros are left out, -0.0 included); None where it would take
    ``shorter_than`` bytes or more, found before the costly steps where it can be (a dense part, every reply of
    fp16 pseudo-gradients, is then refused in about 1 ms rather than 20)."""
    positions = np.flatnonzero(values.view(np.uint16) & 0x7FFF)  # the bits, not fp16 compares (10x slower in numpy)
    kept = values[positions]
    palette, codes, code_bits = _palette_codes(kept)
    value_bytes = math.ceil(kept.size * code_bits / 8) if code_bits else 2 * kept.size
    at_least = HEADER.itemsize + 2 * palette.size + value_bytes + math.ceil(kept.size / 8)  # a bit a position
    if shorter_than is not None and at_least >= shorter_than:
        return None
    gaps = np.diff(positions, prepend=-1) - 1
    rice_k = _best_rice_k(gaps)
    header = np.array([(CODED_FORM, kept.size, code_bits, rice_k, palette.size)], HEADER)
    body = _pack_fixed_width(codes, code_bits) if code_bits else kept.astype("<f2").tobytes()
    remainders = _pack_fixed_width(gaps & ((1 << rice_k) - 1), rice_k)
    coded = b"".join((header.tobytes(), palette.astype("<f2").tobytes(), body, remainders, _unary(gaps >> rice_k)))
    return coded if shorter_than is None or len(coded) < shorter_than else None


def decode(buffer: bytes, numel: int) -> tuple[np.ndarray, np.ndarray]:
    """The non-zero positions (strictly increasing, below ``numel``) and fp16 values of a coded part."""
    if len(buffer) < HEADER.itemsize:
        raise MalformedPart(f"wire part of {len(buffer)} bytes: shorter than the sparse form's header")
    form, count, code_bits, rice_k, palette_size = np.frombuffer(buffer, HEADER, count=1)[0].tolist()
    if form != CODED_FORM:
        raise MalformedPart(f"wire part of form {form}: expected dense fp16 or the sparse form {CODED_FORM}")
    if count > numel:
        raise MalformedPart(f"sparse wire part: {count} values claimed for a part of {numel}")
    if code_bits > MAX_CODE_BITS or (palette_size > 2**code_bits if code_bits else palette_size):
        raise MalformedPart(f"sparse wire part: {palette_size} palette values with {code_bits}-bit codes")
    if rice_k > MAX_RICE_K:
        raise MalformedPart(f"sparse wire part: {rice_k}-bit position remainders, at most {MAX_RICE_K}")
    offset = HEADER.itemsize
    palette = _read(buffer, offset, 2 * palette_size).view("<f2")
    offset += 2 * palette_size
    if code_bits:
        codes = _unpack_fixed_width(_read(buffer, offset, math.ceil(count * code_bits / 8)), count, code_bits)
        offset += math.ceil(count * code_bits / 8)
        if codes.size and codes.max() >= palette_size:
            raise MalformedPart(f"sparse wire part: a code past its palette of {palette_size}")
        values = palette[codes]
    else:
        values = _read(buffer, offset, 2 * count).view("<f2")
        offset += 2 * count
    remainders = _unpack_fixed_width(_read(buffer, offset, math.ceil(count * rice_k / 8)), count, rice_k)
    offset += math.ceil(count * rice_k / 8)
    quotients = _read_unary(np.frombuffer(buffer, np.uint8, offset=offset), count)
    if count and quotients.max() > numel >> rice_k:  # checked before the shift, which could overflow
        raise MalformedPart("sparse wire part: a position outside the part")
    positions = np.cumsum((quotients << rice_k) + remainders + 1) - 1
    if count and positions[-1] >= numel:
        raise MalformedPart("sparse wire part: a position outside the part")
    return positions, values.astype(np.float16)


def _palette_codes(kept: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(palette, codes, code bits) for ``kept`` where at most MAX_PALETTE finite values repeat; else no palette.

    Built on the values' bits: numpy 2.4's sort of fp16 misorders some arrays of few values repeated thousands of
    times (a reply of top-k parts), and its unique then repeats values and misplaces codes."""
    none = np.zeros(0, np.float16), np.zeros(0, np.uint8), 0
    if not np.isfinite(kept).all():
        return none
    bits = kept.view(np.uint16)
    if np.unique(bits[:PALETTE_PROBE]).size > MAX_PALETTE:
        return none  # already too many in a prefix: spares sorting a dense part
    palette_bits = np.unique(bits)
    if palette_bits.size > MAX_PALETTE:
        return none
    code_bits = max(1, math.ceil(math.log2(palette_bits.size))) if palette_bits.size else 1
    if kept.size * code_bits + 16 * palette_bits.size >= 16 * kept.size:
        return none  # the palette and codes cost more than fp16 values
    return palette_bits.view(np.float16), np.searchsorted(palette_bits, bits).astype(np.uint8), code_bits


def _best_rice_k(gaps: np.ndarray) -> int:
    """The remainder width that makes the Rice codes of ``gaps`` shortest: sum(gap >> k) + count * (1 + k) bits."""
    widths = range(min(MAX_RICE_K, int(gaps.max()).bit_length()) + 1) if gaps.size else [0]
    return min(widths, key=lambda k: int((gaps >> k).sum()) + gaps.size * (1 + k))


def _pack_fixed_width(numbers: np.ndarray, width: int) -> bytes:
    """``numbers`` as ``width``-bit strings, most significant bit first, packed and padded to a byte."""
    shifts = np.arange(width - 1, -1, -1, dtype=np.int64)
    bits = (numbers.astype(np.int64)[:, None] >> shifts) & 1
    return np.packbits(bits.reshape(-1).astype(np.uint8)).tobytes()


def _unpack_fixed_width(packed: np.ndarray, count: int, width: int) -> np.ndarray:
    bits = np.unpackbits(packed)[: count * width].reshape(count, width).astype(np.int64)
    return (bits << np.arange(width - 1, -1, -1, dtype=np.int64)).sum(axis=1)


def _unary(quotients: np.ndarray) -> bytes:
    """Each quotient q as q ones closed by a zero, packed and padded with zeros to a byte."""
    lengths = quotients.astype(np.int64) + 1
    bits = np.ones(int(lengths.sum()), np.uint8)
    bits[np.cumsum(lengths) - 1] = 0
    return np.packbits(bits).tobytes()


def _read_unary(packed: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` quotients of ``_unary``'s bytes, which must hold them and their padding, nothing more."""
    bits = np.unpackbits(packed)
    zeros = np.flatnonzero(bits == 0)[:count]
    if zeros.size < count or packed.size != (math.ceil((zeros[-1] + 1) / 8) if count else 0):
        raise MalformedPart(f"sparse wire part: positions do not hold the {count} values claimed")
    if bits[zeros[-1] + 1 :].any() if count else False:
        raise MalformedPart("sparse wire part: bits set after the last position")
    return np.diff(zeros, prepend=-1) - 1


def _read(buffer: bytes, offset: int, size: int) -> np.ndarray:
    if offset + size > len(buffer):
        raise MalformedPart(f"sparse wire part of {len(buffer)} bytes: shorter than its header says")
    return np.frombuffer(buffer, np.uint8, count=size, offset=offset)
