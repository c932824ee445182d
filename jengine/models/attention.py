"""Device-side attention inputs: the paged `KVCache` and one step's `AttentionMetadata`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jengine.cpu_kernels.attention import write_kv_cpu
from jengine.cpu_kernels.kv_zeros import untouched_zeros
from jengine.models.config import ModelConfig
from jengine.pallas_kernels import (
    attention_fn,
    blocked_paged_attention,
    is_quantized,
    quantize_rows,
    ragged_paged_attention,
    shard_for_context_mesh,
    shard_write_for_context_mesh,
    write_kv,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Stacked paged KV cache; page 0 is a scratch page that padding tokens write into.

    Under multi-head latent attention (`ModelConfig.latent_attention`, DeepSeek-V2) `k` holds
    one row per token, the latent and the rope key ([L, 1, P, O, kv_lora_rank + rope dim]), and
    `v` is empty ([L, 1, P, O, 0]): the values are the latent columns of the same rows
    (`attend_latent`), so nothing is stored twice. `v` stays a (zero-byte) leaf so that the
    cache has one pytree structure and one sharding for every family.

    A quantized cache (`--kv-cache-dtype int8` or `fp8`) holds each row as int8 or float8_e4m3fn
    with one f32 scale per (token, kv head) in `k_scale` / `v_scale`
    (`pallas_kernels.kv_quant`); a float cache keeps
    them as zero-byte leaves [L, K, P, O, 0], for the same reason. The scales are written and
    sharded like the rows (the trailing axis of 1 lets the same KV write serve them).

    A Gated DeltaNet hybrid (`ModelConfig.linear_layers`, Qwen3.5) keeps pages for its
    attention layers only (L counts those) and, for each of its Ll linear layers, a fixed-size
    recurrent state per sequence slot N beside them: the last C-wide inputs of its causal conv
    and its [Dk, Dv] DeltaNet state per value head. Slot 0 is a scratch slot, as page 0 is;
    `AttentionMetadata.state_slots` names each row's slot. Pure-attention models keep both as
    zero-byte leaves. Every state leaf keeps its slot axis at 2 (`copy_state_slots`, the prefix
    cache's snapshots, relies on it and on nothing else of its shape).
    """

    k: jax.Array  # [L, K, P, O, D]
    v: jax.Array  # [L, K, P, O, D]; [L, K, P, O, 0] under latent attention
    k_scale: jax.Array  # [L, K, P, O, 1] f32 for int8 / fp8, else [L, K, P, O, 0]
    v_scale: jax.Array  # [L, K, P, O, 1] f32 for int8 / fp8 (not latent), else [L, K, P, O, 0]
    conv: jax.Array  # [Ll, 1, N, kernel - 1, C] f32 the conv's last inputs, oldest first
    ssm: jax.Array  # [Ll, Hv, N, Dk, Dv] f32 the DeltaNet state

    @classmethod
    def of_each(cls, leaf, state=None) -> KVCache:
        """The same `leaf` in every field (`state`, where given, in the recurrent-state ones):
        a sharding for each of the cache's arrays."""
        state = leaf if state is None else state
        return cls(k=leaf, v=leaf, k_scale=leaf, v_scale=leaf, conv=state, ssm=state)

    @property
    def quantized(self) -> bool:
        """Whether rows are int8 or fp8 with scales."""
        return is_quantized(self.k.dtype)

    @classmethod
    def zeros(cls, cfg: ModelConfig, num_pages: int, page_size: int, dtype, *,
              untouched: bool = False, state_slots: int = 0) -> KVCache:
        """An empty cache. `untouched` (inside a program for one CPU device): the same zeros,
        made without writing them (`cpu_kernels.kv_zeros`), so start-up pays no page
        faults for pages no step has used yet. `state_slots`: the recurrent-state slots of a
        hybrid model (its running sequences + the scratch slot 0).

        Raises:
          ValueError: a hybrid model without state slots.
        """
        if cfg.num_linear_layers and state_slots < 2:
            raise ValueError(f"{cfg.model_type} needs recurrent-state slots (got {state_slots})")
        shape = (cfg.num_kv_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
        rows = shape[:-1]
        scaled = is_quantized(dtype)
        n = state_slots if cfg.num_linear_layers else 0
        structs = [(shape, dtype), (rows + (0,) if cfg.latent_attention else shape, dtype),
                   (rows + (int(scaled),), jnp.float32),
                   (rows + (int(scaled and not cfg.latent_attention),), jnp.float32),
                   ((cfg.num_linear_layers, 1, n, max(cfg.linear_conv_kernel - 1, 0),
                     cfg.linear_conv_dim), jnp.float32),
                   ((cfg.num_linear_layers, cfg.linear_v_heads, n, cfg.linear_k_dim,
                     cfg.linear_v_dim), jnp.float32)]
        if untouched:
            return cls(*untouched_zeros(*(jax.ShapeDtypeStruct(*s) for s in structs)))
        return cls(*(jnp.zeros(*s) for s in structs))

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype) -> int:
        """Bytes of one page over all layers and kv heads, scales included."""
        row = cfg.head_dim * jnp.dtype(dtype).itemsize
        if is_quantized(dtype):
            row += jnp.dtype(jnp.float32).itemsize  # the row's scale
        copies = 1 if cfg.latent_attention else 2  # latent rows only, else keys and values
        return copies * cfg.num_kv_layers * page_size * cfg.num_kv_heads * row

    def copy_state_slots(self, pairs: jax.Array) -> KVCache:
        """Each state leaf's slot `pairs[0, i]` copied to slot `pairs[1, i]` (axis 2, the slot
        axis of every state leaf), skipped on the device when every pair is (0, 0): prefix
        caching's snapshots on a hybrid model (`scheduling.state_snapshots`). `pairs`: [2, M]
        int32 (source, destination), destinations distinct except the scratch 0."""
        src, dst = pairs[0], pairs[1]

        def copy(states):
            return tuple(a.at[:, :, dst].set(jnp.take(a, src, axis=2)) for a in states)

        conv, ssm = jax.lax.cond(jnp.any(dst > 0), copy, lambda states: states,
                                 (self.conv, self.ssm))
        return dataclasses.replace(self, conv=conv, ssm=ssm)

    @staticmethod
    def bytes_per_state_slot(cfg: ModelConfig) -> int:
        """Bytes of one sequence's recurrent state over all linear layers (0 without any)."""
        conv = (cfg.linear_conv_kernel - 1) * cfg.linear_conv_dim
        ssm = cfg.linear_v_heads * cfg.linear_k_dim * cfg.linear_v_dim
        return 4 * cfg.num_linear_layers * (conv + ssm)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionMetadata:
    """Where each query token sits: its sequence, position, KV slot, and each sequence's pages.

    T is the token bucket, S the sequence bucket, Pmax the pages-per-sequence bucket. Padding
    tokens point at sequence 0, position 0 and a slot in the scratch page 0.
    """

    token_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32
    slot_mapping: jax.Array  # [T] int32
    token_seq: jax.Array  # [T] int32
    page_table: jax.Array  # [S, Pmax] int32
    logits_indices: jax.Array  # [S] int32 flat index of each sequence's last query token
    # Reference backend, prefill-heavy buckets only (else None): queries grouped per sequence in
    # blocks of B, the real blocks first (NB is the bucket's bound; the rest are empty).
    block_tokens: jax.Array | None = None  # [NB, B] int32 flat token per row; T = padding
    block_seq: jax.Array | None = None  # [NB] int32
    # Hybrid models: each row's recurrent-state slot (`KVCache.conv` / `.ssm`; padding rows:
    # the scratch slot 0). None: row r holds slot r + 1.
    state_slots: jax.Array | None = None  # [S] int32
    # Steps with LoRA adapters only (else None): each token's adapter slot, -1 for none.
    lora_slots: jax.Array | None = None  # [T] int32
    # Image rows (vision families only, else None): `embeds` [M, E] replace the token embeddings
    # of the query tokens whose `embeds_at` [T] int32 names a row (-1: keep the token's own).
    embeds: jax.Array | None = None
    embeds_at: jax.Array | None = None
    # Multimodal rope (Qwen2.5-VL only, else None): each token's (time, row, column) rope
    # positions; `positions` stays its index in the sequence (KV slots, masks).
    mrope_positions: jax.Array | None = None  # [3, T] int32
    # Qwen3-VL's DeepStack rows (else None): added to the first K layers' outputs at the
    # tokens `embeds_at` names, row by row as `embeds`.
    deepstack: jax.Array | None = None  # [K, M, E]


def attend(
    q: jax.Array,  # [T, H, D]
    k: jax.Array,  # [T, K, D]
    v: jax.Array,  # [T, K, D]
    kv: KVCache,
    layer: jax.Array,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    sliding_window: jax.Array | int | None,
    soft_cap: float | None,
    kv_head_map: tuple[int, ...] | None = None,
    backend: str = "reference",  # reference | cpu | pallas_tpu | pallas_gpu (resolved)
    chunk: jax.Array | int | None = None,
    platform: str | None = None,  # the kernels' target (`ModelConfig.platform`)
    sinks: jax.Array | None = None,  # [H] gpt-oss's sink logits
) -> tuple[jax.Array, KVCache]:
    """Writes this layer's new K/V into the pages, then attends over the cache.

    `sinks` (gpt-oss): a learned logit per q head joins each softmax's denominator; the
    `reference` and `cpu` backends take it, the Pallas ones are refused at start
    (`core.build.check_sinks`).

    `chunk` (Llama 4's chunked attention: a query sees the keys of its own `chunk`-token
    chunk only) runs on the reference backend; the engine drops it where the context fits in
    one chunk and refuses other backends at start otherwise (`core.build.chunk_for_context`).

    The kernel backends group query tokens into blocks themselves (they ignore
    `md.block_tokens`); on CPU the Pallas ones run in interpret mode. Traced under
    `jax.set_mesh` with a `tp` axis, they run per shard in `shard_map` (a kernel call is opaque
    to the partitioner). The `cpu` backend also writes K/V with its own in-place FFI write
    (XLA's scatter on a bf16 cache rewrites the whole cache), per shard under such a mesh.
    An int8 or fp8 cache is written as quantized rows and their scales, and read dequantized:
    int8 by every backend, fp8 by all but `cpu` (refused at engine start).
    """
    with jax.named_scope("kv_write"):
        kv = _write(kv, layer, md.slot_mapping, k, v, backend=backend, kv_head_map=kv_head_map)
    with jax.named_scope("attention"):
        return _attention(q, kv, layer, md, sm_scale=sm_scale, sliding_window=sliding_window,
                          soft_cap=soft_cap, kv_head_map=kv_head_map, backend=backend,
                          chunk=chunk, platform=platform, sinks=sinks), kv


def attend_latent(
    q: jax.Array,  # [T, H, C + R]: each head's query in latent space, then its rope part
    rows: jax.Array,  # [T, 1, C + R]: the normed latent, then the rotated shared rope key
    kv: KVCache,
    layer: jax.Array,
    md: AttentionMetadata,
    *,
    value_dim: int,  # C
    sm_scale: float,
    kv_head_map: tuple[int, ...] | None = None,
    backend: str = "reference",
) -> tuple[jax.Array, KVCache]:
    """Multi-head latent attention over the compressed cache: writes this layer's rows, then
    attends with every q head over the one latent kv head (MQA) and returns the outputs in
    latent space, [T, H, C] (the caller maps them out through W_UV).

    Scores are q . row over the whole row (q_latent . c + q_pe . k_pe); the values are the
    rows' first C columns. Every backend takes the cache as both its keys and its values (the
    same buffer, nothing copied) and returns [T, H, C + R], of which the last R columns
    (softmax-weighted rope keys) are dropped: R / (C + R) extra value work, 11% at
    DeepSeek-V2's 512 + 64, for one kernel signature.

    A quantized cache quantizes the whole latent row with one scale (`k_scale`, read for the keys
    and the values alike).

    Raises:
      ValueError: a Pallas backend (not built for latent rows: the TPU kernel's lanes want
        head dims in multiples of 128, and neither kernel has been checked on 576-wide rows).
    """
    if backend not in ("reference", "cpu"):
        raise ValueError(f"multi-head latent attention (deepseek_v2) runs on the 'reference' "
                         f"and 'cpu' attention backends, not {backend!r}")
    with jax.named_scope("kv_write"):
        kv = _write(kv, layer, md.slot_mapping, rows, None, backend=backend,
                    kv_head_map=kv_head_map)
    with jax.named_scope("attention"):
        shared = dataclasses.replace(kv, v=kv.k, v_scale=kv.k_scale)
        out = _attention(q, shared, layer, md, sm_scale=sm_scale, sliding_window=None,
                         soft_cap=None, kv_head_map=kv_head_map, backend=backend)
    return out[..., :value_dim], kv


def _write(kv: KVCache, layer, slot_mapping, k, v, *, backend: str, kv_head_map) -> KVCache:
    """This layer's new rows (v None: latent rows, k only) into their slots, quantized first
    for an int8 or fp8 cache; the `cpu` backend writes in place with its FFI write."""
    write = write_kv
    if backend == "cpu":
        write = shard_write_for_context_mesh(write_kv_cpu, kv_replicated=kv_head_map is not None)

    def put(cache, scales, new):
        if new is None:
            return cache, scales
        if not kv.quantized:
            return write(cache, layer, slot_mapping, new), scales
        rows, scale = quantize_rows(new, cache.dtype)
        return write(cache, layer, slot_mapping, rows), write(scales, layer, slot_mapping, scale)

    (k_cache, k_scale), (v_cache, v_scale) = put(kv.k, kv.k_scale, k), put(kv.v, kv.v_scale, v)
    return dataclasses.replace(kv, k=k_cache, v=v_cache, k_scale=k_scale, v_scale=v_scale)


def _attention(q, kv, layer, md, *, sm_scale, sliding_window, soft_cap, kv_head_map, backend,
               chunk=None, platform=None, sinks=None):
    args = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                kv_head_map=kv_head_map)
    if sinks is not None:
        if backend not in ("reference", "cpu"):
            raise ValueError(f"attention sinks run on the 'reference' and 'cpu' attention "
                             f"backends, not {backend!r}")
        args["sinks"] = sinks
    if kv.quantized:
        args.update(k_scale=kv.k_scale, v_scale=kv.v_scale)
    if chunk is not None:
        if backend != "reference":
            raise ValueError(f"chunked attention runs on the 'reference' attention backend, "
                             f"not {backend!r}")
        args["attention_chunk"] = chunk
    if backend != "reference":
        return shard_for_context_mesh(attention_fn(backend, platform))(
            q, kv.k, kv.v, layer, md.token_seq, md.positions, md.page_table, **args)
    if md.block_tokens is not None:
        return blocked_paged_attention(
            q, kv.k, kv.v, layer, md.positions, md.page_table, md.block_tokens, md.block_seq,
            **args)
    return ragged_paged_attention(
        q, kv.k, kv.v, layer, md.token_seq, md.positions, md.page_table, **args)

