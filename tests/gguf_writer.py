"""Tiny GGUF files written the way llama.cpp's converter writes them, for the tests that read
GGUF: the llama header, a byte-level BPE vocabulary, q/k rows permuted, experts stacked, llama3
rope scaling as `rope_freqs.weight`, and a random HF model of each architecture to compare with."""

from __future__ import annotations

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as Q


def add_llama_header(w: gguf.GGUFWriter, *, hidden: int, ffn: int, layers: int, heads: int,
                      kv_heads: int, rope_theta: float = 10000.0) -> None:
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(rope_theta)


def write_gguf(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
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


def llama_cpp_experts(state: dict, width: int) -> dict:
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


def gguf_name(hf_key: str) -> str:
    if hf_key in GGUF_NAMES:
        return GGUF_NAMES[hf_key]
    _, _, layer, rest = hf_key.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}"


def llama_cpp_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
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


def write_tiny_llama(path, rope: dict | None = None, arch: str = "llama", *,
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
    add_llama_header(w, hidden=hidden, ffn=MOE["width"] if mixtral else 96, layers=2,
                      heads=heads, kv_heads=kv_heads, rope_theta=theta)
    if head_dim != hidden // heads:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "qwen3moe" or mixtral:
        w.add_expert_count(MOE["experts"])
        w.add_expert_used_count(MOE["top_k"])
        w.add_expert_feed_forward_length(MOE["width"])
        state = llama_cpp_experts(state, MOE["width"])
    add_tiny_vocab(w, vocab)
    if rope:
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(rope, hidden // heads))
    for key, value in state.items():
        if arch == "llama" and key.endswith("q_proj.weight"):
            value = llama_cpp_permute(value, heads, heads)
        elif arch == "llama" and key.endswith("k_proj.weight"):
            value = llama_cpp_permute(value, heads, kv_heads)
        value = np.ascontiguousarray(value, np.float32)
        if value.ndim == 2 and matrices != Q.F32:
            blocks = gguf.quants.quantize(value, matrices)
            if dequantized:
                w.add_tensor(gguf_name(key), gguf.quants.dequantize(blocks, matrices))
            else:
                w.add_tensor(gguf_name(key), blocks, raw_dtype=matrices)
        else:
            w.add_tensor(gguf_name(key), value)
    write_gguf(w)
    return path, model, state
