"""GGUF reading: dequantization against hand-built blocks, and the llama q/k permutation.

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
import jax
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from paged import run_paged  # tests/paged.py: pytest puts tests/ on sys.path

from converters import load_source
from converters.gguf_file import GGUFModel

ROWS = 3
COLS = 512  # two 256-element super-blocks per row, sixteen 32-element blocks
TOL = 1e-4  # logits tolerance of the end-to-end check (see tests/test_models_parity.py)


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


def _add_llama_header(w: gguf.GGUFWriter, *, hidden: int, ffn: int, layers: int, heads: int,
                      kv_heads: int, rope_theta: float = 10000.0) -> None:
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(rope_theta)


def _write(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def quant_file(tmp_path_factory):
    """One GGUF holding a [ROWS, COLS] tensor of every type; returns (path, expectations)."""
    path = tmp_path_factory.mktemp("gguf") / "quants.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    _add_llama_header(w, hidden=COLS, ffn=COLS, layers=len(BUILDERS), heads=4, kv_heads=4)
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
    _write(w)
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


# ----------------------------------------------------------------------------- q/k permutation


def _llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """`LlamaModel.permute` of llama.cpp's convert_hf_to_gguf.py, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_proj.weight": "ffn_gate_exps.weight",
    "mlp.experts.up_proj.weight": "ffn_up_exps.weight",
    "mlp.experts.down_proj.weight": "ffn_down_exps.weight",
}


MOE = {"experts": 8, "top_k": 2, "width": 32}


def _llama_cpp_experts(state: dict, width: int) -> dict:
    """transformers' in-memory experts (gate_up_proj [X, 2F, E], down_proj [X, E, F]) as
    llama.cpp's converter writes them: one stacked tensor per weight, [X, out, in]."""
    out = {}
    for key, value in state.items():
        if key.endswith("experts.gate_up_proj"):
            out[key.replace("gate_up_proj", "gate_proj.weight")] = value[:, :width]
            out[key.replace("gate_up_proj", "up_proj.weight")] = value[:, width:]
        elif key.endswith("experts.down_proj"):
            out[key + ".weight"] = value
        else:
            out[key] = value
    return out


def _gguf_name(hf_key: str) -> str:
    if hf_key in GGUF_NAMES:
        return GGUF_NAMES[hf_key]
    _, _, layer, rest = hf_key.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}"


def _llama_cpp_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """The `rope_freqs.weight` tensor llama.cpp's converter writes for llama3 rope scaling:
    per-frequency divisors of inv_freq (`LlamaModel.generate_extra_tensors`)."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old_context_len / high:
            out.append(1.0)
        elif wavelen > old_context_len / low:
            out.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def add_tiny_vocab(w: gguf.GGUFWriter, vocab: int) -> None:
    """A byte-level BPE vocabulary: printable characters, two merges of them, bos and eos."""
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(33 + i) for i in range(vocab - 4)] + ['!"', "#$", "<s>", "</s>"])
    w.add_token_types([gguf.TokenType.NORMAL] * (vocab - 2) + [gguf.TokenType.CONTROL] * 2)
    w.add_token_merges(['! "', "# $"])
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)


def _tiny_llama_gguf(path, rope: dict | None = None, arch: str = "llama", *,
                    mixtral: bool = False, matrices=Q.F32, dequantized: bool = False):
    """A random HF Llama (GQA 4q/2kv) written as a GGUF the way llama.cpp converts it (F32, or
    its 2-D weights in `matrices`, quantized by gguf-py, which matches llama.cpp's bit for bit;
    `dequantized`: those weights' values after that quantization, written as F32):
    q/k rows permuted, llama3 rope scaling (if any) as a `rope_freqs.weight` tensor. With
    `arch="qwen3"`: a Qwen3 (q/k norms, head_dim 32 apart from hidden // heads), not permuted
    (llama.cpp permutes only its `llama` architecture). `arch="qwen3moe"` or `mixtral` (a
    `llama` file): 8 experts, top 2, stacked per layer as llama.cpp writes them."""
    heads, kv_heads, hidden, vocab = 4, 2, 64, 96
    kwargs = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=128,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
    )
    head_dim = hidden // heads
    if arch == "qwen3":
        head_dim = 32
        config = transformers.Qwen3Config(**kwargs, head_dim=head_dim)
        model_cls = transformers.Qwen3ForCausalLM
    elif arch == "qwen3moe":  # llama.cpp's graph renormalises the top-k weights: so does HF here
        config = transformers.Qwen3MoeConfig(**kwargs, num_experts=MOE["experts"],
                                             num_experts_per_tok=MOE["top_k"],
                                             moe_intermediate_size=MOE["width"],
                                             norm_topk_prob=True)
        model_cls = transformers.Qwen3MoeForCausalLM
    elif mixtral:  # llama.cpp writes Mixtral as a `llama` file with experts
        kwargs["intermediate_size"] = MOE["width"]
        config = transformers.MixtralConfig(**kwargs, num_local_experts=MOE["experts"],
                                            num_experts_per_tok=MOE["top_k"])
        model_cls = transformers.MixtralForCausalLM
    else:
        config = transformers.LlamaConfig(**kwargs)
        model_cls = transformers.LlamaForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_cls(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.3 * noise if "norm" in name else noise / p.shape[-1] ** 0.5)
    state = {k: v.numpy() for k, v in model.state_dict().items()}

    w = gguf.GGUFWriter(str(path), arch)
    theta = (rope or {}).get("rope_theta", 10000.0)
    _add_llama_header(w, hidden=hidden, ffn=MOE["width"] if mixtral else 96, layers=2,
                      heads=heads, kv_heads=kv_heads, rope_theta=theta)
    if head_dim != hidden // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "qwen3moe" or mixtral:
        w.add_expert_count(MOE["experts"])
        w.add_expert_used_count(MOE["top_k"])
        w.add_expert_feed_forward_length(MOE["width"])
        state = _llama_cpp_experts(state, MOE["width"])
    add_tiny_vocab(w, vocab)
    if rope:
        w.add_tensor("rope_freqs.weight", _llama_cpp_rope_freqs(rope, hidden // heads))
    for key, value in state.items():
        if arch == "llama" and key.endswith("q_proj.weight"):
            value = _llama_cpp_permute(value, heads, heads)
        elif arch == "llama" and key.endswith("k_proj.weight"):
            value = _llama_cpp_permute(value, heads, kv_heads)
        value = np.ascontiguousarray(value, np.float32)
        if value.ndim == 2 and matrices != Q.F32:
            blocks = gguf.quants.quantize(value, matrices)
            if dequantized:
                w.add_tensor(_gguf_name(key), gguf.quants.dequantize(blocks, matrices))
            else:
                w.add_tensor(_gguf_name(key), blocks, raw_dtype=matrices)
        else:
            w.add_tensor(_gguf_name(key), value)
    _write(w)
    return path, model, state


@pytest.fixture(scope="module")
def tiny_llama_gguf(tmp_path_factory):
    return _tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf")


def _gguf_logits_diff(path, model) -> float:
    loaded = load_source(str(path), dtype="float32", progress=False)
    ids = np.random.default_rng(2).integers(3, 96, 24).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    got = run_paged(loaded, ids, prefill_chunk=7, decode_steps=6, page_size=4)
    return float(np.abs(got - expected).max())


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


def test_gguf_qk_permutation_is_undone(tiny_llama_gguf):
    path, _, state = tiny_llama_gguf
    got = dict(GGUFModel(path).tensors())
    assert set(got) == set(state)
    for key, want in state.items():
        np.testing.assert_array_equal(got[key], want, err_msg=key)
    # The permutation is not the identity for these shapes: skipping its inverse would show.
    q = state["model.layers.0.self_attn.q_proj.weight"]
    k = state["model.layers.0.self_attn.k_proj.weight"]
    assert not np.array_equal(_llama_cpp_permute(q, 4, 4), q)
    assert not np.array_equal(_llama_cpp_permute(k, 4, 2), k)


def test_gguf_llama_logits_match_transformers(tiny_llama_gguf):
    path, model, _ = tiny_llama_gguf
    loaded = load_source(str(path), dtype="float32", progress=False)
    assert loaded.kind == "gguf" and loaded.config.num_kv_heads == 2
    assert loaded.tokenizer('!"#$a</s>').input_ids == [92, 93, 64, 95]  # merges, "a", eos
    assert _gguf_logits_diff(path, model) < TOL


def test_gguf_weights_are_placed_on_the_cpu_without_a_copy(tiny_llama_gguf):
    """One CPU device, float weights: every placed weight, each layer's slice included, uses the
    assembled host array's memory (XLA:CPU aliases 64-byte-aligned arrays), so a start pays
    neither a second copy of the weights nor its page faults."""
    from jengine.core.build import place_weights

    path, _, _ = tiny_llama_gguf
    loaded = load_source(str(path), dtype="float32", progress=False)
    params = place_weights(loaded, loaded.config, None, dtype="float32", quantization="none",
                           layer_layout="unstacked", quantize_lm_head=False, smoothing_alpha=0.0,
                           progress=False)
    hosts = [np.asarray(w) for w in loaded.params.values()]
    spans = [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in hosts]
    leaves = jax.tree.leaves(params)
    assert len(leaves) > len(hosts)  # the layers were split
    for leaf in leaves:
        assert any(lo <= leaf.unsafe_buffer_pointer() < hi for lo, hi in spans), leaf.shape


def test_gguf_qwen3(tmp_path):
    path, model, _ = _tiny_llama_gguf(tmp_path / "qwen3.gguf", arch="qwen3")
    loaded = load_source(str(path), dtype="float32", progress=False)
    assert loaded.config.model_type == "qwen3" and loaded.config.qk_norm
    assert loaded.config.head_dim == 32
    assert _gguf_logits_diff(path, model) < TOL


def test_gguf_qwen3_moe(tmp_path):
    # llama.cpp's layout: a router per layer and each expert weight stacked [X, out, in].
    path, model, _ = _tiny_llama_gguf(tmp_path / "qwen3moe.gguf", arch="qwen3moe")
    cfg = load_source(str(path), dtype="float32", progress=False).config
    assert (cfg.model_type, cfg.num_experts, cfg.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert cfg.moe_intermediate_size == 32 and cfg.norm_topk_prob and cfg.qk_norm
    assert _gguf_logits_diff(path, model) < TOL


def test_gguf_mixtral(tmp_path):
    # A `llama` GGUF with expert tensors is Mixtral; its q/k rows are permuted like Llama's.
    path, model, _ = _tiny_llama_gguf(tmp_path / "mixtral.gguf", mixtral=True)
    cfg = load_source(str(path), dtype="float32", progress=False).config
    assert (cfg.model_type, cfg.num_experts, cfg.moe_intermediate_size) == ("mixtral", 8, 32)
    assert _gguf_logits_diff(path, model) < TOL


def test_gguf_llama31_rope_freqs(tmp_path):
    """llama.cpp stores llama3 rope scaling as a `rope_freqs.weight` tensor of divisors."""
    rope = {
        "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
    }
    path, model, _ = _tiny_llama_gguf(tmp_path / "llama31.gguf", rope)
    assert GGUFModel(path).hf_config()["rope_scaling"]["rope_type"] == "freq_factors"
    assert _gguf_logits_diff(path, model) < TOL
