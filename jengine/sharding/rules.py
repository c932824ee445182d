"""Logical axis names -> mesh axes, and the query-head padding that makes any head count fit tp.

Every parameter declares logical axes (`ParamSpec.axes`): q heads, MLP columns and the
vocabulary are split over `tp` (so wq/w_gate/w_up are column-parallel, wo/w_down row-parallel,
embedding and lm_head vocab-parallel; XLA inserts the all-reduces). KV heads are split when
`num_kv_heads % tp == 0` and replicated otherwise. The KV cache `[L, K, P, O, D]` follows the
kv-head rule, so each device holds the pages of its own heads.

When q heads do not divide tp (SmolLM2: 9 q / 3 kv heads), `pad_query_heads` appends zero
heads (zero wq columns, zero wo rows, zero bias) up to a multiple of tp and records the kv head
of every q head in `ModelConfig.kv_head_map`; attention then pairs heads through that map
instead of by contiguous groups, and the padded heads contribute exactly zero.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jengine.models import family_module
from jengine.models.config import ModelConfig
from jengine.models.layers import ParamSpec
from jengine.sharding.mesh import TP


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Maps logical axes to the `tp` mesh axis (None = replicated)."""

    mesh: Mesh
    kv_heads_sharded: bool

    @classmethod
    def for_model(cls, mesh: Mesh, cfg: ModelConfig) -> ShardingRules:
        tp = mesh.shape[TP]
        check_divisible(cfg, tp)
        return cls(mesh=mesh, kv_heads_sharded=cfg.num_kv_heads % tp == 0)

    def axis(self, logical: str) -> str | None:
        if logical in ("q_heads", "mlp", "vocab"):  # `mlp` includes each MoE expert's columns
            return TP
        if logical == "kv_heads":
            return TP if self.kv_heads_sharded else None
        return None

    def sharding(self, axes: tuple[str, ...]) -> NamedSharding:
        spec = PartitionSpec(*(self.axis(a) for a in axes))
        return NamedSharding(self.mesh, spec)

    def param_shardings(self, specs: dict[str, ParamSpec]) -> dict[str, NamedSharding]:
        return {name: self.sharding(spec.axes) for name, spec in specs.items()}

    def kv_cache_sharding(self) -> NamedSharding:
        return self.sharding(("layers", "kv_heads", "pages", "page_offset", "head_dim"))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())


def check_divisible(cfg: ModelConfig, tp: int) -> None:
    """The splits tp needs; checked from the config, before any weight is read."""
    if cfg.intermediate_size % tp:
        raise ValueError(
            f"tp={tp} does not divide the MLP width {cfg.intermediate_size} of this model"
        )
    if cfg.num_experts and cfg.moe_intermediate_size % tp:
        raise ValueError(
            f"tp={tp} does not divide the expert MLP width {cfg.moe_intermediate_size}"
        )
    if cfg.vocab_size % tp:
        raise ValueError(f"tp={tp} does not divide the vocabulary size {cfg.vocab_size}")


def padded_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config `pad_query_heads` gives, from the config alone (no weight is touched): q heads
    rounded up to a multiple of tp with `kv_head_map` set, or `cfg` itself when kv heads split
    over tp. Sharded loading builds its target shapes from it before reading anything."""
    if tp == 1 or cfg.num_kv_heads % tp == 0:
        return cfg
    heads = cfg.num_heads
    padded = -(-heads // tp) * tp
    group = heads // cfg.num_kv_heads
    kv_map = tuple(h // group if h < heads else 0 for h in range(padded))
    return dataclasses.replace(cfg, num_heads=padded, kv_head_map=kv_map,
                               padded_heads=padded - heads)


def pad_query_heads(
    cfg: ModelConfig, params: dict[str, np.ndarray], tp: int
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Zero-pads q heads to a multiple of tp and sets `kv_head_map` when kv heads are not split.

    With kv heads split over tp (kv_heads % tp == 0) the contiguous GQA groups already line up
    with the shards and nothing changes. Otherwise every device needs every kv head (they are
    replicated) and only the q heads are split, so the map pairs each (possibly padded) q head
    with its kv head.
    """
    padded_cfg = padded_config(cfg, tp)
    if padded_cfg is cfg:
        return cfg, params
    out = dict(params)
    for name, spec in family_module(cfg).param_specs(cfg).items():
        if "q_heads" in spec.axes:  # wq, wo, bq, OLMo 2's q_norm
            widths = [(0, 0)] * len(spec.shape)
            widths[spec.axes.index("q_heads")] = (0, padded_cfg.num_heads - cfg.num_heads)
            out[name] = np.pad(params[name], widths)
    return padded_cfg, out
