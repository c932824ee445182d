"""A step program lowered for another platform from this machine: how the accelerators' steps
are checked and read on a CPU (tests/runtime/test_step_lowering.py: no conditionals or loops
outside the kernels; scripts/gpu_step_profile.py --dump: the programs as text). Nothing here
compiles or runs a program. `Runner.for_platform` / `Runner.export` call these (for scripts,
which stay on the engine's objects).
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax

from jengine.runtime import warmup_plan
from jengine.runtime.step_io import Variant


def for_platform(runner, platform: str, attention_backend: str, params: dict):
    """A runner of `runner`'s model, buckets and cache size whose programs are built for
    `platform` with `attention_backend`, around `params` (laid out as that platform loads
    them): what `export` lowers for an accelerator from this machine."""
    cfg = dataclasses.replace(runner.cfg, platform=platform, attention_backend=attention_backend,
                              matmul_backend="xla")
    return type(runner)(cfg, params, num_pages=runner.num_pages, page_size=runner.page_size,
                        buckets=runner.buckets, kv_cache_dtype=runner.kv_cache_dtype)


def export(runner, shape: tuple[int, int, int], variant: Variant,
           platforms: tuple[str, ...]) -> jax.export.Exported:
    """The step program of bucket `shape` (T, S, P) and `variant`, lowered for `platforms` by
    `jax.export` and not compiled. The runner's model config must name the target platform,
    so the kernels are built for it (Triton's custom call has no compatibility promise: that
    one check is off)."""
    host, picked = warmup_plan.dummy_inputs(runner, shape, variant)
    lora = runner.loras.tree if picked.lora else None
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                            (runner.params, runner.kv, runner._device_inputs(host),
                             runner._no_tokens, lora))
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    mesh = runner._kernel_mesh
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        return jax.export.export(jax.jit(runner._step_fn, **runner._jit_kwargs),
                                 platforms=platforms, disabled_checks=[triton])(
            *abstract, variant=picked)
