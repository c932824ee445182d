"""Zero arrays made without writing them (`csrc/kv_zeros.cc`): the KV cache at start-up.

XLA fills a `jnp.zeros` result by writing every byte, so a 2 GiB cache costs 2 GiB of
first-touch page faults before the first request (1.5-5 s in a VM). The native target maps the
whole pages fresh instead (calloc's way), and the OS fills each with zeros on its first write.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jengine.cpu_kernels import library

_TARGET = "jengine_zeros"


def untouched_zeros(*structs: jax.ShapeDtypeStruct) -> tuple[jax.Array, ...]:
    """Zero arrays of these shapes for a program on one CPU device, made without writing them:
    their whole pages are fresh mappings that the OS fills with zeros on first touch (calloc's
    way), so a 2 GiB KV cache costs page faults only for the pages steps write. The result is
    `jnp.zeros`'s, and is `jnp.zeros` itself when the library lacks the target."""
    if not library.has_target(_TARGET):
        return tuple(jnp.zeros(s.shape, s.dtype) for s in structs)
    return tuple(jax.ffi.ffi_call(library.target(_TARGET), structs)())
