"""A GGUF file's header, metadata and tensors, read in a fraction of a second.

`gguf.GGUFReader` (llama.cpp's Python reader) builds a NumPy view per metadata element: the
bundled SmolLM2's 49,152-token vocabulary and 48,900 merges cost it ~4.6 s of a 2-core start.
This reader parses the header with `struct` from one bytes buffer and maps the tensor data
lazily (`np.memmap`), so opening a file reads only its header. Block formats are dequantized with
whole-tensor NumPy operations where the layout is simple (F32, F16, BF16, Q8_0, Q4_0, Q4_1: the
bundled models' formats); every other format goes to `gguf.quants`, which knows them all.

Layout (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, metadata count
u64; metadata as (key string, value type u32, value); tensor infos as (name string, n_dims u32,
dims u64 x n_dims (innermost first), type u32, data offset u64); then the data, aligned to
`general.alignment` (32 by default). A string is a u64 byte length and UTF-8 bytes.
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# value type id -> struct format of one scalar (8: string, 9: array are parsed apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader can parse (bad magic, version, truncation)."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor: `shape` in NumPy order (outermost first, the reverse of GGUF's dims)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    offset: int  # from the start of the file
    nbytes: int


class _Cursor:
    """Reads little-endian values from `buf`, advancing `pos`."""

    def __init__(self, buf: bytes):
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFFormatError("string runs past the end of the header")
        text = self.buf[self.pos:end].decode("utf-8")
        self.pos = end
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array(self.scalar("I"), self.scalar("Q"))
        if vtype not in _SCALARS:
            raise GGUFFormatError(f"unknown metadata value type {vtype}")
        return self.scalar(_SCALARS[vtype])

    def array(self, vtype: int, count: int) -> list:
        if vtype == _STRING:
            return [self.string() for _ in range(count)]
        if vtype == _ARRAY:
            return [self.array(self.scalar("I"), self.scalar("Q")) for _ in range(count)]
        if vtype not in _NUMPY:
            raise GGUFFormatError(f"unknown metadata array type {vtype}")
        dtype = np.dtype(_NUMPY[vtype]).newbyteorder("<")
        values = np.frombuffer(self.buf, dtype, count, self.pos)  # raises when truncated
        self.pos += values.nbytes
        return values.tolist()


class GGUFReader:
    """`metadata` (key -> Python value: str, int, float, bool, or a list of them) and
    `tensors` (`TensorInfo`s in file order); `data(info)` maps one tensor's raw bytes.

    Raises:
      GGUFFormatError: not a GGUF v2/v3 file, or truncated or corrupt.
    """

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(24)
            if head[:4] != MAGIC:
                raise GGUFFormatError("not a GGUF file (bad magic)")
            version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
            if version not in VERSIONS:
                raise GGUFFormatError(f"GGUF version {version} is not supported "
                                      "(little-endian v2/v3 only)")
            # The header is usually well under 10 MB; read more if it is not.
            want = min(size, 1 << 23)
            while True:
                f.seek(0)
                buf = f.read(want)
                try:
                    self._parse(buf, n_tensors, n_kv, gguf)
                    break
                except (struct.error, ValueError, IndexError) as e:
                    if want >= size:
                        raise GGUFFormatError(f"corrupt or truncated header: {e}") from e
                    want = min(size, want * 4)
        for info in self.tensors:
            if info.offset + info.nbytes > size:
                raise GGUFFormatError(f"tensor {info.name} runs past the end of the file")
        self._map = np.memmap(self.path, np.uint8, "r") if self.tensors else None

    def _parse(self, buf: bytes, n_tensors: int, n_kv: int, gguf) -> None:
        cur = _Cursor(buf)
        cur.pos = 24
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.scalar("I"))
        raw = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar("Q") for _ in range(cur.scalar("I"))]
            raw.append((name, tuple(reversed(dims)), cur.scalar("I"), cur.scalar("Q")))
        align = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
        if align <= 0 or align & (align - 1):
            raise GGUFFormatError(f"alignment {align} is not a power of two")
        start = -(-cur.pos // align) * align
        tensors = []
        for name, shape, type_id, offset in raw:
            qtype = gguf.GGMLQuantizationType(type_id)
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            count = int(np.prod(shape, dtype=np.int64))
            if count % block:
                raise GGUFFormatError(f"tensor {name}: {count} elements in blocks of {block}")
            tensors.append(TensorInfo(name, shape, qtype, start + offset,
                                      count // block * block_bytes))
        self.metadata = meta
        self.tensors = tensors

    def data(self, info: TensorInfo) -> np.ndarray:
        """The tensor's raw bytes, uint8 [nbytes], mapped from the file (nothing read yet)."""
        return self._map[info.offset:info.offset + info.nbytes]


def dequantize(info: TensorInfo, raw: np.ndarray) -> np.ndarray:
    """float32 array of `info.shape` from the tensor's raw bytes.

    Raises:
      NotImplementedError: `gguf.quants` has no dequantizer for the format either.
    """
    import gguf

    Q = gguf.GGMLQuantizationType
    kind = info.tensor_type
    if kind == Q.F32:
        return raw.view("<f4").reshape(info.shape)
    if kind == Q.F16:
        return raw.view("<f2").astype(np.float32).reshape(info.shape)
    if kind == Q.BF16:
        bits = raw.view("<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(info.shape)
    fast = _BLOCKS.get(kind.name)
    if fast is not None:
        block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
        return fast(np.asarray(raw).reshape(-1, block_bytes)).reshape(info.shape)
    # gguf.quants wants rows of bytes: [..., bytes per innermost row]
    rows = np.asarray(raw).reshape(*info.shape[:-1], -1)
    return np.asarray(gguf.quants.dequantize(rows, kind), np.float32).reshape(info.shape)


def _scale(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, as float32 [n_blocks, 1]."""
    return blocks[:, at:at + 2].copy().view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] packed bytes -> [n, 32] uint8: the low nibbles are elements 0-15, the high 16-31."""
    out = np.empty((qs.shape[0], 32), np.uint8)
    np.bitwise_and(qs, 0x0F, out=out[:, :16])
    np.right_shift(qs, 4, out=out[:, 16:])
    return out


def _q8_0(blocks: np.ndarray) -> np.ndarray:  # f16 d, 32 x int8: d * q
    return blocks[:, 2:].view(np.int8) * _scale(blocks, 0)


def _q4_0(blocks: np.ndarray) -> np.ndarray:  # f16 d, 16 bytes of nibbles: d * (q - 8)
    q = _nibbles(blocks[:, 2:]).view(np.int8)
    q -= 8
    return q * _scale(blocks, 0)


def _q4_1(blocks: np.ndarray) -> np.ndarray:  # f16 d, f16 m, 16 bytes of nibbles: d * q + m
    out = _nibbles(blocks[:, 4:]) * _scale(blocks, 0)
    out += _scale(blocks, 2)
    return out


_BLOCKS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1}


# The 4-bit block formats `four_bit_groups` converts: (elements a block, bytes a block).
FOUR_BIT = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}


def four_bit_groups(info: TensorInfo, raw: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0 / Q4_1 / Q4_K tensor's blocks as 4-bit groups of 32 along its innermost axis,
    without a float copy of the tensor: (q uint8 [*shape] in 0..15, s and m float32
    [*shape[:-1], shape[-1] / 32]), `s * q + m` (float32) equal to `gguf.quants.dequantize`'s
    values bit for bit. Q4_0: s = d, m = -8 d; Q4_1: s = d, m as stored; Q4_K: per sub-block
    of 32, s = d * scale, m = -(dmin * min) (its 6-bit scales and mins unpacked).

    Raises:
      ValueError: another format.
    """
    kind = info.tensor_type.name
    if kind not in FOUR_BIT:
        raise ValueError(f"{info.name} is {kind}, not one of the 4-bit formats {sorted(FOUR_BIT)}")
    block_bytes = FOUR_BIT[kind][1]
    blocks = np.asarray(raw).reshape(-1, block_bytes)
    groups = blocks.shape[0] * FOUR_BIT[kind][0] // 32
    if kind == "Q4_K":
        q, s, m = _q4_k_groups(blocks)
    else:
        at = 4 if kind == "Q4_1" else 2
        q = _nibbles(blocks[:, at:])
        s = _scale(blocks, 0)
        m = _scale(blocks, 2) if kind == "Q4_1" else s * np.float32(-8)
    lead = info.shape[:-1]
    return (q.reshape(info.shape), s.reshape(*lead, -1).astype(np.float32),
            m.reshape(*lead, -1).astype(np.float32)) if groups else (q, s, m)


def _q4_k_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [n, 144] (f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128
    bytes of nibbles) -> q [n * 8, 32], s and m [n * 8, 1]: sub-block j of 32 takes the low
    nibbles of bytes 32 (j // 2).. for even j, the high ones for odd j."""
    import gguf

    n = blocks.shape[0]
    d = _scale(blocks, 0)  # [n, 1]
    dmin = _scale(blocks, 2)
    sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [n, 8] each
    s = (d * sc.astype(np.float32)).reshape(-1, 1)
    m = -(dmin * mn.astype(np.float32)).reshape(-1, 1)
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (qs & np.uint8(15)).reshape(n * 8, 32), s, m
