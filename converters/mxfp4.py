"""MXFP4 tensors (gpt-oss's published experts) read as the float tensors they stand for.

A checkpoint with `quantization_config.quant_method: mxfp4` stores each expert weight `W` as
`W_blocks` uint8 [X, R, G, 16] and `W_scales` uint8 [X, R, G]: for each of the R output rows,
G groups of 32 input values, each an e2m1 code (4 bits: sign, 2 exponent bits, 1 mantissa bit;
two codes a byte, the low nibble first) times one e8m0 scale 2^(s - 127) per group. The float
weight HF's unquantized gpt-oss holds is that [X, R, G * 32] transposed to [X, G * 32, R]
(input-first), which is what `W` means in a float checkpoint.

`wrap(handle)` gives a safetensors handle whose `W_blocks` / `W_scales` pairs read as `W`,
dequantized to float32, slice by slice (a sharded load reads the blocks its slice needs only),
so the family's ordinary weight rules and every loader path take them unchanged. Kept as
floats after the load: a 4-bit expert kernel is not built (the experts then hold 4.25 / 16 of
their bf16 bytes' information in bf16 or f32 memory).
"""

from __future__ import annotations

import numpy as np

# The 16 e2m1 values by code: sign bit 3, then exponent and mantissa.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
GROUP = 32  # values per scale
_BLOCKS, _SCALES = "_blocks", "_scales"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> float32 [..., G * 32], as stored
    (output rows first)."""
    blocks = np.asarray(blocks, np.uint8)
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], GROUP)
    exponents = np.asarray(scales, np.int32) - 127
    values = np.ldexp(E2M1[codes], exponents[..., None])
    return values.reshape(*blocks.shape[:-2], -1).astype(np.float32)


def wrap(handle):
    """`handle` (safetensors `safe_open`, numpy) as is, or where it holds MXFP4 pairs, a view
    that reads each pair as its float tensor."""
    keys = list(handle.keys())
    pairs = {k[:-len(_BLOCKS)] for k in keys
             if k.endswith(_BLOCKS) and k[:-len(_BLOCKS)] + _SCALES in keys}
    return _Mxfp4Handle(handle, keys, pairs) if pairs else handle


class _Mxfp4Handle:
    """The safetensors handle's `keys`, `get_slice`, `get_tensor`, with the pairs dequantized."""

    def __init__(self, handle, keys: list[str], pairs: set[str]):
        self._handle, self._pairs = handle, pairs
        paired = {p + s for p in pairs for s in (_BLOCKS, _SCALES)}
        self._keys = [k for k in keys if k not in paired] + sorted(pairs)

    def keys(self) -> list[str]:
        return list(self._keys)

    def get_slice(self, key: str):
        if key not in self._pairs:
            return self._handle.get_slice(key)
        return _Dequantized(self._handle.get_slice(key + _BLOCKS),
                            self._handle.get_slice(key + _SCALES))

    def get_tensor(self, key: str) -> np.ndarray:
        if key not in self._pairs:
            return self._handle.get_tensor(key)
        return self.get_slice(key)[:]


class _Dequantized:
    """One MXFP4 pair as a float32 [X, G * 32, R] slice source: `[index]` reads the blocks
    and scales of the rows and groups the index covers."""

    def __init__(self, blocks, scales):
        self._blocks, self._scales = blocks, scales
        x, r, g, width = blocks.get_shape()
        if width * 2 != GROUP or tuple(scales.get_shape()) != (x, r, g):
            raise ValueError(f"MXFP4 blocks {blocks.get_shape()} and scales "
                             f"{scales.get_shape()} do not pair")
        self._shape = (x, g * GROUP, r)

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        index = index + (slice(None),) * (3 - len(index))
        (x0, x1, _), (i0, i1, _), (r0, r1, _) = (
            s.indices(n) for s, n in zip(index, self._shape, strict=True))
        i1, r1 = max(i0, i1), max(r0, r1)
        if x1 <= x0 or i1 <= i0 or r1 <= r0:
            return np.zeros((max(x1 - x0, 0), i1 - i0, r1 - r0), np.float32)
        g0, g1 = i0 // GROUP, -(-i1 // GROUP)
        rows = dequantize(self._blocks[x0:x1, r0:r1, g0:g1], self._scales[x0:x1, r0:r1, g0:g1])
        return np.swapaxes(rows, 1, 2)[:, i0 - g0 * GROUP:i1 - g0 * GROUP]
