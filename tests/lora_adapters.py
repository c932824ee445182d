"""Tiny random base models and random PEFT LoRA adapters for the LoRA tests, with HF
transformers + PEFT as the oracle (peft is a test-only dependency)."""

from __future__ import annotations

from pathlib import Path

import peft
import torch
import transformers
from tiny_models import random_hf_model  # tests/tiny_models.py

VOCAB = 96
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = ATTENTION + ["gate_proj", "up_proj", "down_proj"]

_FAMILIES = {
    # SmolLM2's shape, scaled down: tied embeddings, 3 kv heads under 9 q heads.
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, 1.0, dict(
        hidden_size=72, intermediate_size=96, num_attention_heads=9, num_key_value_heads=3,
        head_dim=8, tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, 1.0, dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, tie_word_embeddings=False)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, 0.0, dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, query_pre_attn_scalar=24, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)),
    # 16 q / 8 kv heads: splits evenly over tp=2 (and 8).
    "llama_16x8": (transformers.LlamaConfig, transformers.LlamaForCausalLM, 1.0, dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=16, num_key_value_heads=8,
        head_dim=8, tie_word_embeddings=False)),
}


def base_model(path: Path, family: str) -> torch.nn.Module:
    """A 2-layer random model of `family` saved at `path`; returns it (the base oracle)."""
    config_cls, model_cls, norm_offset, kw = _FAMILIES[family]
    config = config_cls(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=512,
                        bos_token_id=1, eos_token_id=2, **kw)
    return random_hf_model(path, config, model_cls, norm_offset=norm_offset)


def random_adapter(base_path: Path, out: Path, family: str, *, r: int, alpha: float,
                   targets: list[str] = ALL_LINEAR, seed: int = 0, rslora: bool = False,
                   **config) -> torch.nn.Module:
    """A PEFT LoRA adapter with random A and B (B nonzero, so the adapter moves the logits),
    saved at `out`; returns the base model with it applied (the adapter's oracle)."""
    _, model_cls, _, _ = _FAMILIES[family]
    base = model_cls.from_pretrained(base_path, attn_implementation="eager")
    lora = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                           init_lora_weights=False, **config)
    model = peft.get_peft_model(base, lora)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    model.save_pretrained(out)
    return model.eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """`steps` greedy tokens after `prompt` (full recompute each step: the plainest oracle)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
