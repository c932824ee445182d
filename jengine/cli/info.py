"""`jengine info`: a model described from its files, without loading the engine: its
architecture, size and stored precision, and what `dtype: auto` runs for it on this machine."""

from __future__ import annotations

import argparse
import math


def cmd_info(args: argparse.Namespace) -> int:
    from converters.source import load_source
    from jengine.engine import describe_auto_dtype
    from jengine.models.registry import family_of

    loaded = load_source(args.model, progress=True)
    cfg = loaded.config
    network = family_of(cfg).network
    specs = network.param_specs(cfg)  # every weight the model holds, counted exactly
    info = {
        "source": loaded.source,
        "format": loaded.kind,
        "architecture": cfg.model_type,
        "family": network.name,  # the model file that runs it
        "parameters": sum(math.prod(spec.shape) for spec in specs.values()),
        "dtype": str(next(iter(loaded.params.values())).dtype),
        "auto_dtype": describe_auto_dtype(cfg),  # what `--dtype auto` (the default) runs here
        "quantization": loaded.quantization,  # of the stored weights
        "weights": loaded.weights_note,  # which stored formats read as int8, which as float
        "layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "heads": f"{cfg.num_heads} q / {cfg.num_kv_heads} kv, head_dim {cfg.head_dim}",
        "vocab_size": cfg.vocab_size,
        "context_length": cfg.max_position_embeddings,
        "sliding_window": cfg.sliding_window,
        "tied_embeddings": cfg.tie_word_embeddings,
        "chat_template": bool(getattr(loaded.tokenizer, "chat_template", None)),
    }
    if cfg.rope.rope_type != "default":
        info["rope"] = f"{cfg.rope.rope_type}, theta {cfg.rope.theta:g}"
    if cfg.num_experts:
        shared = cfg.shared_expert_intermediate_size
        info["experts"] = (f"{cfg.num_experts} ({cfg.num_experts_per_tok} per token), "
                           f"width {cfg.moe_intermediate_size}"
                           + (f", shared {shared}" if shared else ""))
    if cfg.latent_attention:
        info["latent_attention"] = (
            f"kv_lora_rank {cfg.kv_lora_rank} + rope {cfg.qk_rope_head_dim} cached per token "
            f"and layer, q_lora_rank {cfg.q_lora_rank or 'none'}, "
            f"{cfg.first_dense_layers} dense layers first")
    if cfg.num_linear_layers:
        from jengine.models import KVCache
        per_seq = KVCache.bytes_per_state_slot(cfg)
        mixer = "Mamba2" if cfg.linear_mixer == "mamba2" else "Gated DeltaNet"
        info["linear_layers"] = (
            f"{cfg.num_linear_layers} of {cfg.num_layers} {mixer} (KV pages for "
            f"{cfg.num_kv_layers} attention layers); recurrent state {per_seq / 2**10:.1f} KiB "
            "f32 per running sequence, taken from kv_cache_memory before its pages")
        # The prefix cache's snapshots (jengine.core.startup.snapshot_slots) under the defaults.
        snapshots = min(64, (2 * 2**30 - 65 * per_seq) // 4 // per_seq)
        info["state_snapshots"] = (
            f"{snapshots} prefix-cache snapshots of that size under the defaults (max_num_seqs "
            "64, kv_cache_memory 2GiB): max_num_seqs, or a quarter of what the running "
            "states leave, whichever is fewer")
    for k, v in info.items():
        print(f"{k:16} {v}")
    return 0
