"""Fused q/k/v and gate/up weights (`jengine.models.fused`, what accelerators load) give the
greedy tokens of the separate ones, on one device and split over tp, where each device holds
exactly the columns it held before."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from paged import greedy_paged  # tests/paged.py

from jengine.models import ModelConfig, family_module
from jengine.models.config import RopeConfig
from jengine.models.fused import can_fuse, fuse_projections
from jengine.models.layers import unstack_layers
from jengine.sharding import ShardingRules
from jengine.sharding.mesh import TP

PROMPTS = [[1, 5, 9, 13, 2, 7, 30, 4, 8], [11, 3, 3, 60]]
CFG = ModelConfig(
    model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
    num_heads=8, num_kv_heads=4, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5,
    rope=RopeConfig(), sliding_layers=(False, False),
)


def per_layer_params(tp: int) -> dict:
    """Random f32 weights large enough for distinct logits, per layer, split over `tp`."""
    network = family_module(CFG)
    specs = network.param_specs(CFG)
    shardings = None
    if tp > 1:
        mesh = Mesh(np.asarray(jax.devices()[:tp]), (TP,))
        shardings = ShardingRules.for_model(mesh, CFG).param_shardings(specs)
    key = jax.random.key(0)
    params = {}
    for i, (name, s) in enumerate(sorted(specs.items())):
        w = (jnp.ones(s.shape) if s.init == "ones"
             else 0.3 * jax.random.normal(jax.random.fold_in(key, i), s.shape))
        params[name] = jax.device_put(w, shardings[name]) if shardings else w
    return unstack_layers(params, network.layer_keys, CFG.num_layers)


@pytest.mark.parametrize("tp", [1, 2])
def test_each_device_holds_its_own_columns(tp):
    params = per_layer_params(tp)
    assert can_fuse(params, CFG, family_module(CFG))
    separate = {name: [np.asarray(p[name]) for p in params["layers"]]
                for name in ("w_gate", "w_up")}
    shards = [{name: [np.asarray(s.data) for s in sorted(p[name].addressable_shards,
                                                          key=lambda s: s.device.id)]
               for name in ("wq", "wk", "wv")} for p in params["layers"]]
    fused = fuse_projections(params, CFG)
    for i, p in enumerate(fused["layers"]):
        assert "wq" not in p and "w_up" not in p
        assert p["w_qkv"].shape == (64, tp, (8 + 2 * 4) // tp, 16)
        assert p["w_gate_up"].shape == (64, tp, 2, 96 // tp)
        # Each device's block of the fused weight: its own q, then k, then v heads.
        fused_shards = sorted(p["w_qkv"].addressable_shards, key=lambda s: s.device.id)
        assert len(fused_shards) == tp
        for j, shard in enumerate(fused_shards):
            own = [shards[i][n][j] for n in ("wq", "wk", "wv")]
            np.testing.assert_array_equal(np.asarray(shard.data)[:, 0], np.concatenate(own, 1))
        gate_up = np.asarray(p["w_gate_up"])
        np.testing.assert_array_equal(gate_up[:, :, 0].reshape(64, -1), separate["w_gate"][i])
        np.testing.assert_array_equal(gate_up[:, :, 1].reshape(64, -1), separate["w_up"][i])


@pytest.mark.slow  # CI: the shard layout above, and the fused CUDA step's lowering
@pytest.mark.parametrize("tp", [1, 2])
def test_fused_weights_give_the_same_greedy_tokens(tp):
    params = per_layer_params(tp)
    expected = greedy_paged((CFG, params), PROMPTS, 4, prefill_chunk=16, page_size=4)
    fused = fuse_projections(params, CFG)
    jax.clear_caches()  # `paged._step` caches its program per cfg: retrace on the fused tree
    assert greedy_paged((CFG, fused), PROMPTS, 4, prefill_chunk=16, page_size=4) == expected


def test_biased_or_replicated_layers_are_not_fused():
    params = per_layer_params(1)
    biased = {**params, "layers": tuple({**p, "bq": p["wq"][0]} for p in params["layers"])}
    assert not can_fuse(biased, CFG, family_module(CFG))
    assert not can_fuse(params, CFG.__class__(**{**CFG.__dict__, "kv_head_map": (0,) * 8}),
                        family_module(CFG))
