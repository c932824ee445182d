"""`PackedInputs`: a step's small input arrays as one int32 buffer, so that an accelerator's step
takes one host-to-device copy where it took one per array.

A `StepInputs` holds ~13 arrays (token rows, page table, the sampler's nine per-row settings,
...), each its own transfer, and each transfer a launch on the step's critical path; the bytes
are few (a few KiB at 256 rows). The host lays every array of at most `PACK_MAX_BYTES` end to
end as 32-bit words (bool as 0/1, float32 / uint32 bit for bit) and the step program slices
them back out at static offsets (free: slices and bitcasts of one buffer). Larger arrays (a
features step's logit bias [S, V], a vision step's image rows) travel as they are: copying them
into the buffer first would cost the host more than the transfer it saves. XLA:CPU has no
transfer to save, so the CPU's steps take `StepInputs` unpacked (`Runner`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

PACK_MAX_BYTES = 1 << 20  # larger arrays are sent apart (see the module docstring)
_WORD_DTYPES = (np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32), np.dtype(bool))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of the inputs' tree is: ("packed", offset, shape, dtype) in the words,
    or ("apart", index) among the arrays sent as they are. Static: part of the program."""

    treedef: Any
    leaves: tuple[tuple, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedInputs:
    """One step's inputs: `words` [N] int32 (the small arrays, end to end) and `apart` (the
    large ones), with their `layout` (static)."""

    words: Any
    apart: tuple
    layout: Layout = dataclasses.field(metadata={"static": True})

    @classmethod
    def of(cls, inputs: Any) -> PackedInputs:
        """Packs a tree of NumPy arrays (a `StepInputs`) on the host."""
        leaves, treedef = jax.tree.flatten(inputs)
        words, apart, where, offset = [], [], [], 0
        for a in leaves:
            a = np.asarray(a)
            if a.dtype in _WORD_DTYPES and a.nbytes <= PACK_MAX_BYTES:
                flat = a.reshape(-1)
                flat = flat.astype(np.int32) if a.dtype == bool else flat.view(np.int32)
                where.append(("packed", offset, a.shape, a.dtype.str))
                words.append(flat)
                offset += flat.size
            else:
                where.append(("apart", len(apart)))
                apart.append(a)
        packed = np.concatenate(words) if words else np.zeros((0,), np.int32)
        return cls(words=packed, apart=tuple(apart), layout=Layout(treedef, tuple(where)))

    def unpack(self) -> Any:
        """The inputs' tree back, each leaf in its shape and dtype (traced inside the step)."""
        out = []
        for leaf in self.layout.leaves:
            if leaf[0] == "apart":
                out.append(self.apart[leaf[1]])
                continue
            _, offset, shape, dtype = leaf
            dtype = np.dtype(dtype)
            chunk = self.words[offset:offset + int(np.prod(shape, dtype=np.int64))]
            if dtype == np.dtype(bool):
                value = chunk != 0
            elif dtype == np.int32:
                value = chunk
            else:
                value = jax.lax.bitcast_convert_type(chunk, dtype)
            out.append(value.reshape(shape))
        return jax.tree.unflatten(self.layout.treedef, out)
