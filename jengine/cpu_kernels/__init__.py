"""jengine's native CPU kernels: C++ (`csrc/`) built into one library by the install and called
inside jitted programs through `jax.ffi`.

`library` loads it and registers every FFI target from the library's own table; one module per
kernel wraps its calls: `attention` (paged attention and the in-place KV write, the `cpu`
attention backend), `kv_zeros` (a cache made without writing it), `matmul` (small-row and AMX
bf16 products), `int8_matmul` (W8A8 on VNNI and AMX-INT8), `rms_norm`. docs/kernels.md has the
measurements; docs/design.md the recipe for adding a kernel.
"""
