"""Tensor parallelism on the 8 fake CPU devices (conftest): mesh specs, errors before any weight
loads, parameter placement, and greedy outputs equal to the single-device engine.

Two head layouts are covered: SmolLM2 (9 q / 3 kv heads: kv heads replicated, q heads padded to
a multiple of tp with the explicit q -> kv map) and a tiny random Llama whose 16 q / 8 kv heads
split evenly (kv heads and the KV cache sharded over tp).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import transformers
from tokenizers import Tokenizer, models
from verify_all import ngram_speculation  # tests/verify_all.py

from jengine import Engine, SamplingParams
from jengine.core.replicas import choose_replica
from jengine.models import KVCache
from jengine.sharding import MeshSpec

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
ONE_BUCKET = str(Path(__file__).parents[1] / "one_bucket.yaml")  # one program per engine
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a robot", "2+2="]


def test_routing_prefers_the_longest_cached_prefix_unless_much_busier():
    slack = 16
    assert choose_replica([0, 0], [10, 5], slack) == 1  # nothing cached: the least loaded
    assert choose_replica([32, 0], [10, 5], slack) == 0  # a hit is worth a small imbalance
    assert choose_replica([32, 0], [40, 5], slack) == 1  # not a large one (> 1.5 x 5 + 16)
    assert choose_replica([32, 32], [10, 5], slack) == 1  # equal hits: the least loaded
    assert choose_replica([16, 48, 0], [0, 10, 0], slack) == 1
    assert choose_replica([16, 48, 0], [0, 20, 0], slack) == 0  # 1 is too busy: next best hit
    assert choose_replica([0, 48, 16], [0, 20, 3], slack) == 2


def test_mesh_spec_parses_tp_and_dp():
    assert MeshSpec.parse("tp=8") == MeshSpec(dp=1, tp=8)
    assert MeshSpec.parse("dp=2,tp=4") == MeshSpec(dp=2, tp=4)
    assert MeshSpec.parse(" tp=4 , dp=2 ") == MeshSpec(dp=2, tp=4)
    assert MeshSpec.parse("dp=2").num_devices == 2


@pytest.mark.parametrize("spec", ["tp8", "tp=", "tp=x", "pp=2", "tp=2,tp=4", "tp=0", ""])
def test_bad_mesh_spec_is_a_clear_error(spec):
    with pytest.raises(ValueError, match="mesh"):
        MeshSpec.parse(spec)


def test_more_devices_than_exist_fails_before_loading():
    with pytest.raises(ValueError, match=r"needs 16 devices; 8 cpu device\(s\) available"):
        Engine(config="test", mesh="tp=16")


def test_indivisible_mlp_fails_before_any_weight_loads(tmp_path):
    # A config whose MLP width (36) does not divide tp=8, and no weight files at all: the
    # divisibility error must come first.
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=36, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=8,
    )
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    with pytest.raises(ValueError, match="tp=8 does not divide the MLP width 36"):
        Engine(str(tmp_path), config="test", mesh="tp=8")


def _greedy(engine: Engine, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(prompts, GREEDY)]


def _per_device_table(engine: Engine, tp: int) -> None:
    """Prints and checks bytes per device: 1/tp of the total for every tp-sharded weight."""
    print(f"\n{'param':24s} {'total MiB':>10s} {'device 0 MiB':>13s}  spec")
    leaves = jax.tree_util.tree_leaves_with_path(engine.core.runner.params)
    for name, w in sorted((jax.tree_util.keystr(path), w) for path, w in leaves):
        shards = w.addressable_shards
        per_device = {s.device: s.data.nbytes for s in shards}
        spec = w.sharding.spec
        print(f"{name:24s} {w.nbytes / 2**20:10.2f} {per_device[shards[0].device] / 2**20:13.2f}"
              f"  {spec}")
        expected = w.nbytes // tp if "tp" in tuple(spec) else w.nbytes
        assert set(per_device.values()) == {expected}, name


@pytest.mark.slow  # tp in CI on the tiny Llama / OLMo 2 and multi-host; SmolLM2 at tp ~27 s
def test_smollm2_tensor_parallel_matches_one_device(smol_engine):
    """tp=8 (other tp sizes: test_quant.py, test_kernel_backends.py, test_multihost.py): SmolLM2's
    9 q heads pad to 16, its 3 kv heads replicate; greedy tokens, with and without speculation,
    are the one-device engine's."""
    tp = 8
    engine = Engine(config=ONE_BUCKET, mesh=f"tp={tp}", warmup=True)
    try:
        assert _greedy(engine, PROMPTS) == _greedy(smol_engine, PROMPTS)
        _speculation_keeps_outputs(engine, smol_engine)
        cfg = engine.core.model_config
        assert cfg.num_heads == 16 and len(cfg.kv_head_map) == cfg.num_heads
        _per_device_table(engine, tp)
        # 3 kv heads do not split over tp: every device holds the whole cache, and all
        # tp copies come out of the one host budget (fake devices share this host).
        assert tuple(engine.core.runner.kv.k.sharding.spec) in ((), (None,) * 5)
        per_page = KVCache.bytes_per_page(cfg, 16, engine.core.kv_cache_dtype)
        assert engine.core.allocator.num_pages == 256 * 2**20 // tp // per_page
        assert engine.core.compiles_since_ready == 0
    finally:
        del engine


def _speculation_keeps_outputs(engine: Engine, smol_engine: Engine) -> None:
    """n-gram speculation on the sharded engine, every proposal verified: greedy outputs stay
    the one-device engine's."""
    prompts = PROMPTS + ["1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,", "la la la la la la la"]
    want = _greedy(smol_engine, prompts)
    with ngram_speculation(engine) as sched:
        assert _greedy(engine, prompts) == want
        assert sched.spec_counters.num_accepted_tokens > 0


def test_tiny_llama_with_sharded_kv_heads_matches_one_device(tiny_llama):
    """8 kv heads over tp=8 (one a device) and tp=4 inside dp=2 (two a device); tp=2 (four a
    device) is test_kernel_backends.py's: this model on the `cpu` and Pallas GPU kernels there
    equals the one-device reference backend's tokens."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 96, n).tolist() for n in (5, 17, 40, 70)]
    outputs = {}
    for mesh in ("tp=1", "tp=8", "dp=2,tp=4"):
        engine = Engine(str(tiny_llama), config=ONE_BUCKET, mesh=mesh)
        outputs[mesh] = _greedy(engine, prompts)
        spec = MeshSpec.parse(mesh)
        if spec.dp == 1 and spec.tp > 1:
            assert engine.core.model_config.kv_head_map is None  # 8 kv heads split evenly
            kv_spec = tuple(engine.core.runner.kv.k.sharding.spec)
            assert kv_spec[1] == "tp", kv_spec  # [L, K, P, O, D]: own kv heads' pages per device
            _per_device_table(engine, spec.tp)
        del engine
    for mesh in ("tp=8", "dp=2,tp=4"):
        assert outputs[mesh] == outputs["tp=1"], mesh


def test_cli_mesh_without_devices_is_one_line_error():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "jengine.cli", "generate", "hi", "--mesh", "tp=16"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("jengine: error: mesh tp=16 needs 16 devices;"), last
    assert "--xla_force_host_platform_device_count" in last


def test_tp8_preset():
    from jengine.config import load_config

    cfg = load_config("tp8")
    assert MeshSpec.parse(cfg.parallel.mesh) == MeshSpec(tp=8)
    assert cfg.model.dtype == "auto"


def test_cli_cpu_devices_flag_makes_fake_devices():
    import subprocess
    import sys

    # 16 fake devices: the mesh check passes and the run goes on to the (missing) model path.
    proc = subprocess.run(
        [sys.executable, "-m", "jengine.cli", "generate", "hi", "--mesh", "tp=16",
         "--cpu-devices", "16", "--model", "/nonexistent/model"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "model path not found: /nonexistent/model" in proc.stderr, proc.stderr


@pytest.mark.slow  # dp in CI: test_draft's replicas; SmolLM2 x 2 replicas ~30 s
def test_data_parallel_replicas_match_one_device_and_share_the_load(smol_engine):
    """dp=2 x tp=4 on the real model: replicas on disjoint devices give the one-device tokens,
    split a burst evenly and route a cached prefix to its holder. Its cost is two replicas'
    loads and compiles; no smaller engine has the prefix cache's routing to check."""
    from jengine.core.replicas import ReplicaSet

    expected = _greedy(smol_engine, PROMPTS)
    engine = Engine(config=ONE_BUCKET, mesh="dp=2,tp=4")
    try:
        core = engine.core
        assert isinstance(core, ReplicaSet) and len(core.replicas) == 2
        devices = [set(jax.tree.leaves(r.runner.params)[0].sharding.device_set)
                   for r in core.replicas]
        assert len(devices[0]) == len(devices[1]) == 4 and not devices[0] & devices[1]
        assert _greedy(engine, PROMPTS) == expected
        # 16 requests at once (4 prompts x 4): the least-loaded replica takes each one.
        before = list(core.assigned)
        many = [p + f" {i}" for i in range(4) for p in PROMPTS]
        outs = engine.generate(many, GREEDY)
        split = [a - b for a, b in zip(core.assigned, before)]
        print("requests per replica:", split)
        assert sum(split) == 16 and abs(split[0] - split[1]) <= 2
        assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
        assert not core.has_unfinished and core.stats().kv_pages_used == 0
        # Cache-aware routing: a prompt whose prefix one replica has cached goes there.
        story = "Once upon a time, in a kingdom by the sea, there lived a robot who " * 3
        engine.generate([story + "sang."], GREEDY)
        ids = engine.tokenizer(story).input_ids
        holders = [i for i, r in enumerate(core.replicas) if r.prefix_cache.match_length(ids)]
        assert len(holders) == 1
        before = list(core.assigned)
        again = [engine.generate([story + end], GREEDY)[0] for end in ("danced.", "slept.")]
        assert core.assigned[holders[0]] - before[holders[0]] == 2
        assert all(o.num_cached_tokens >= 32 for o in again)
        assert core.stats().prefix_cache_hit_tokens >= 64
    finally:
        del engine


def test_olmo2_full_width_qk_norm_under_tp_matches_one_device(tmp_path):
    # OLMo 2 normalises q over all heads at once. At tp=8 its 4 q heads pad to 8 (2 kv heads
    # replicate), so the norm's sum runs across devices and must skip the zero heads.
    import torch

    torch.manual_seed(0)
    config = transformers.Olmo2Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = transformers.Olmo2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:  # learned, uneven norm weights
            layer.self_attn.q_norm.weight.normal_(1.0, 0.5)
    model.save_pretrained(tmp_path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(96)}, unk_token="t0"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(
        tmp_path)
    prompts = [np.random.default_rng(1).integers(3, 96, n).tolist() for n in (6, 30)]
    outputs = {}
    for mesh in ("tp=1", "tp=8"):
        engine = Engine(str(tmp_path), config=ONE_BUCKET, mesh=mesh)
        outputs[mesh] = _greedy(engine, prompts)
        if mesh == "tp=8":
            assert engine.core.model_config.padded_heads == 4
        del engine
    assert outputs["tp=8"] == outputs["tp=1"]
