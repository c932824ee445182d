"""The Pallas kernels against the float64 dense oracle and the reference, on CPU in interpret mode.

Batches come from `test_reference_attention.Case` (shuffled pages, garbage in every unwritten
slot, a float64 dense causal oracle). The TPU kernel runs under `pltpu.InterpretParams()` (TPU
emulation: DMAs, semaphores, VMEM), the GPU kernel with `interpret=True`. Both also lower for
their real targets here (`jax.export` to tpu / cuda), with no accelerator.

Tolerance: 2e-5 (relative and absolute) on float32 inputs; the kernels differ from the oracle
only by online-softmax rounding (observed ~4e-7).

Interpret mode costs ~0.5 ms per grid point (TPU emulation more, plus a compile per shape), so
the default run keeps one mixed batch per kernel and the lowering checks; the GQA, page-boundary,
decode/prefill-only, window, soft-cap, head-map and shard_map cases are `slow`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from test_reference_attention import HEAD_DIM, LAYER, MIXED, SHAPES, Case

from jengine.cpu_kernels import attention as cpu
from jengine.pallas_kernels import (
    attention_fn,
    ragged_paged_attention,
    ragged_paged_attention_gpu,
    ragged_paged_attention_tpu,
    resolve_backend,
    shard_for_context_mesh,
    shard_over_heads,
    write_kv,
)
from jengine.pallas_kernels import block_layout as qb

TOL = 2e-5
NO_WINDOW = int(jnp.iinfo(jnp.int32).max)

TPU = functools.partial(ragged_paged_attention_tpu, interpret=pltpu.InterpretParams())
GPU = functools.partial(ragged_paged_attention_gpu, interpret=True)
KERNELS = {"tpu": TPU, "gpu": GPU}


@functools.partial(jax.jit, static_argnames=("kernel", "soft_cap", "kv_head_map"))
def _step(k_cache, v_cache, slots, new_k, new_v, q, token_seq, positions, page_table, window,
          *, kernel, soft_cap, kv_head_map=None):
    """The engine's order: `write_kv` (its own XLA step), then the kernel."""
    layer = jnp.int32(LAYER)
    k_cache = write_kv(k_cache, layer, slots, new_k)
    v_cache = write_kv(v_cache, layer, slots, new_v)
    return kernel(q, k_cache, v_cache, layer, token_seq, positions, page_table,
                  sm_scale=HEAD_DIM ** -0.5, sliding_window=window, soft_cap=soft_cap,
                  kv_head_map=kv_head_map)


def run(case: Case, kernel, *, window=None, soft_cap=None, num_pad=0, kv_head_map=None):
    """The kernel's output for the case's real tokens; `num_pad` bucket-padding tokens (sequence
    0, position 0, scratch page 0) ride along. The window is traced, so cases share programs."""
    x = case.step_inputs()
    if num_pad:
        rng = np.random.default_rng(99)
        num_kv = case.num_kv
        x = {
            "slots": np.concatenate([x["slots"], np.arange(num_pad) % case.page_size]),
            "new_k": np.concatenate([x["new_k"], rng.normal(size=(num_pad, num_kv, HEAD_DIM))]),
            "new_v": np.concatenate([x["new_v"], rng.normal(size=(num_pad, num_kv, HEAD_DIM))]),
            "q": np.concatenate([x["q"], rng.normal(size=(num_pad, case.num_heads, HEAD_DIM))]),
            "token_seq": np.concatenate([x["token_seq"], np.zeros(num_pad, int)]),
            "positions": np.concatenate([x["positions"], np.zeros(num_pad, int)]),
        }
        x = {k: a.astype(np.float32 if a.dtype.kind == "f" else np.int32) for k, a in x.items()}
    out = _step(
        case.k_cache, case.v_cache, *(jnp.asarray(x[k]) for k in (
            "slots", "new_k", "new_v", "q", "token_seq", "positions")),
        jnp.asarray(case.page_table), jnp.int32(NO_WINDOW if window is None else window),
        kernel=kernel, soft_cap=soft_cap, kv_head_map=kv_head_map,
    )
    out = np.asarray(out)
    n = sum(q for _, q in case.seqs)
    assert np.isfinite(out).all()
    return out[:n]


def check(case, kernel, **kw):
    out = run(case, kernel, **kw)
    kw.pop("num_pad", None)
    kw.pop("kv_head_map", None)
    np.testing.assert_allclose(out, case.expected(**kw), rtol=TOL, atol=TOL)
    return out


# --- default (fast) subset -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tpu", "gpu"])
def test_mixed_batch_with_padding_and_window(name):
    """Decodes, fresh and chunked prefills, bucket padding; then a 3-wide window (same program)."""
    case = Case(MIXED, num_heads=6, num_kv_heads=2, page_size=4, seed=1)
    kernel = KERNELS[name]
    kernel = functools.partial(kernel, block_q=4, **(
        {"pages_per_chunk": 2} if name == "tpu" else {"num_kv_splits": 2}))
    check(case, kernel, num_pad=3)
    out = check(case, kernel, window=3, num_pad=3)
    assert not np.allclose(out, case.expected(), rtol=TOL, atol=TOL)


def test_block_layout_groups_each_sequence_and_bounds_its_keys():
    token_seq = jnp.asarray([1, 1, 1, 0, 2, 0, 0], jnp.int32)  # last two: bucket padding
    positions = jnp.asarray([4, 5, 6, 9, 0, 0, 0], jnp.int32)
    layout = jax.jit(qb.make_query_blocks, static_argnums=(2, 3))
    blocks = layout(token_seq, positions, 3, 2, jnp.int32(3))
    assert blocks.rows.shape == (qb.num_query_blocks(7, 3, 2), 2)
    rows = np.asarray(blocks.rows).tolist()
    seqs = np.asarray(blocks.seq).tolist()
    live = [(s, r) for s, r in zip(seqs, rows) if r != [7, 7]]
    assert live == [(0, [3, 5]), (0, [6, 7]), (1, [0, 1]), (1, [2, 7]), (2, [4, 7])]
    hi = np.asarray(blocks.kv_hi)[: len(live)].tolist()
    lo = np.asarray(blocks.kv_lo)[: len(live)].tolist()
    assert hi == [10, 1, 6, 7, 1]
    assert lo == [0, 0, 2, 4, 0]  # window 3: min position - 2
    assert (np.asarray(blocks.kv_hi)[len(live):] == 0).all()  # spare blocks read nothing


def test_backend_resolution():
    assert resolve_backend("auto", "cpu") == ("cpu" if cpu.available() else "reference")
    assert resolve_backend("auto", "tpu") == "pallas_tpu"
    assert resolve_backend("auto", "gpu") == "pallas_gpu"
    assert resolve_backend("pallas_gpu", "cpu") == "pallas_gpu"
    assert attention_fn("reference", "cpu") is ragged_paged_attention
    assert attention_fn("pallas_tpu", "cpu").keywords["interpret"]  # emulation on CPU
    assert attention_fn("pallas_gpu", "cpu").keywords["interpret"] is True
    assert attention_fn("pallas_gpu", "gpu").keywords["interpret"] is False
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("flash", "cpu")
    assert shard_for_context_mesh(GPU) is GPU  # no mesh in context: the kernel itself
    # Decode buckets get one query row per block; prefill buckets up to 16.
    assert [qb.default_block_q(t, s) for t, s in ((64, 64), (64, 8), (512, 64), (512, 1))] == [
        1, 8, 8, 16]


def _abstract_args(num_heads=9, num_kv=3, head_dim=64, dtype=jnp.bfloat16):
    t, layers, pages, page_size, seqs, width = 16, 2, 32, 16, 4, 8
    cache = jax.ShapeDtypeStruct((layers, num_kv, pages, page_size, head_dim), dtype)
    return (
        jax.ShapeDtypeStruct((t, num_heads, head_dim), dtype), cache, cache,
        jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((t,), jnp.int32),
        jax.ShapeDtypeStruct((t,), jnp.int32), jax.ShapeDtypeStruct((seqs, width), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32),
    )


def _exportable(kernel, **kw):
    def fn(q, k, v, layer, token_seq, positions, page_table, window):
        return kernel(q, k, v, layer, token_seq, positions, page_table, sm_scale=0.125,
                      sliding_window=window, soft_cap=30.0, **kw)
    return jax.jit(fn)


def test_tpu_kernel_lowers_for_tpu():
    """SmolLM2's shapes: head_dim 64, 9 q / 3 kv heads, bf16 pages of 16."""
    exported = jax.export.export(_exportable(ragged_paged_attention_tpu), platforms=["tpu"])(
        *_abstract_args())
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize("split", [1, 4])
def test_gpu_kernel_lowers_for_cuda(split):
    """Triton's custom call carries no serialization-compatibility promise, so `jax.export` needs
    that one check disabled; lowering itself (Pallas -> Triton IR) succeeds without a GPU."""
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = jax.export.export(
        _exportable(ragged_paged_attention_gpu, block_q=1 if split > 1 else 16,
                    num_kv_splits=split),
        platforms=["cuda"], disabled_checks=[triton],
    )(*_abstract_args())
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()


# --- slow: the full matrix -------------------------------------------------------------------


@pytest.mark.kernel_sweep
@pytest.mark.parametrize("name", ["tpu", "gpu"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (6, 2), (8, 1)])  # GQA 1, 3, 8
def test_gqa_ratios(name, num_heads, num_kv_heads):
    case = Case(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, page_size=4, seed=2)
    check(case, KERNELS[name])


@pytest.mark.kernel_sweep
@pytest.mark.parametrize("name", ["tpu", "gpu"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_batch_shapes(name, shape):
    case = Case(SHAPES[shape], num_heads=3, num_kv_heads=1, page_size=4, seed=3)
    check(case, KERNELS[name])


@pytest.mark.kernel_sweep
@pytest.mark.parametrize("name", ["tpu", "gpu"])
def test_sliding_windows_and_soft_cap(name):
    case = Case(MIXED, num_heads=8, num_kv_heads=1, page_size=4, seed=6)
    kernel = KERNELS[name]
    for window in (1, 4, 8, 64):
        check(case, kernel, window=window)
    case.q = [q * 8 for q in case.q]  # into the cap's non-linear range
    check(case, kernel, soft_cap=5.0)
    check(case, kernel, window=5, soft_cap=10.0)


@pytest.mark.kernel_sweep
@pytest.mark.parametrize(
    ("name", "blocks"),
    [("tpu", {"block_q": 1, "pages_per_chunk": 1}), ("tpu", {"block_q": 16, "pages_per_chunk": 8}),
     ("gpu", {"block_q": 1, "num_kv_splits": 4, "pages_per_step": 1}),
     ("gpu", {"block_q": 32, "num_kv_splits": 1, "pages_per_step": 8})],
)
def test_block_sizes(name, blocks):
    case = Case(MIXED, num_heads=6, num_kv_heads=2, page_size=16, seed=4)
    check(case, functools.partial(KERNELS[name], **blocks), window=7)


@pytest.mark.kernel_sweep
@pytest.mark.parametrize("name", ["tpu", "gpu"])
def test_explicit_kv_head_map(name):
    """Tensor-parallel layout: 3 kv heads replicated, q heads padded 6 -> 8 with a head map."""
    case = Case(MIXED, num_heads=8, num_kv_heads=3, page_size=4, seed=5)
    head_map = (0, 0, 1, 1, 2, 2, 0, 0)
    out = run(case, KERNELS[name], kv_head_map=head_map)
    ref = run(case, ragged_paged_attention, kv_head_map=head_map)
    np.testing.assert_allclose(out, ref, rtol=TOL, atol=TOL)


@pytest.mark.kernel_sweep
@pytest.mark.parametrize("head_map", [None, (0, 0, 1, 1, 2, 2, 0, 0)])
def test_shard_over_heads(head_map):
    """Per-shard kernels over 4 devices: kv heads split (4 kv / 8 q), or replicated with a map
    and the mesh taken from the tracing context."""
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:4])
    num_kv = 4 if head_map is None else 3
    case = Case(MIXED, num_heads=8, num_kv_heads=num_kv, page_size=4, seed=7)
    kernel = functools.partial(GPU, block_q=8)
    if head_map is None:
        out = run(case, shard_over_heads(kernel, mesh), window=5)
    else:  # as `attend` does it: the mesh comes from `jax.set_mesh` at trace time
        with jax.set_mesh(mesh):
            out = run(case, lambda *a, **k: shard_for_context_mesh(kernel)(*a, **k), window=5,
                      kv_head_map=head_map)
    ref = run(case, ragged_paged_attention, window=5, kv_head_map=head_map)
    np.testing.assert_allclose(out, ref, rtol=TOL, atol=TOL)


@pytest.mark.kernel_sweep
@pytest.mark.parametrize("backend", ["pallas_tpu", "pallas_gpu"])
def test_model_greedy_tokens_match_reference(backend, monkeypatch):
    """A tiny random Llama (one sliding-window layer) through the paged path, chunked prefill then
    ragged decodes: the same greedy tokens with the kernel as with the reference."""
    from paged import greedy_paged

    import jengine.models.llama as llama
    from jengine.models import ModelConfig, family_module
    from jengine.models.config import RopeConfig

    cfg = ModelConfig(
        model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=2,
        num_heads=6, num_kv_heads=2, head_dim=16, max_position_embeddings=128,
        rms_norm_eps=1e-5, rope=RopeConfig(), sliding_window=5, sliding_layers=(True, False),
    )
    key = jax.random.key(0)
    params = {
        name: jnp.ones(s.shape) if s.init == "ones"
        else 0.3 * jax.random.normal(jax.random.fold_in(key, i), s.shape)
        for i, (name, s) in enumerate(sorted(family_module(cfg).param_specs(cfg).items()))
    }
    prompts = [[1, 5, 9, 13, 2, 7, 30], [4, 8], [11, 3, 3, 3, 60, 21, 22, 23, 24, 25, 26, 27]]
    ref = greedy_paged((cfg, params), prompts, 4, prefill_chunk=8, page_size=4)
    jax.clear_caches()  # `paged._step` caches its program per cfg: retrace with the kernel
    monkeypatch.setattr(llama, "attend", functools.partial(llama.attend, backend=backend))
    assert greedy_paged((cfg, params), prompts, 4, prefill_chunk=8, page_size=4) == ref
    jax.clear_caches()
