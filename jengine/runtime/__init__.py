"""The device side of a step: the `Runner` (bucketed, compiled step programs over the paged KV
cache), the sampler inside them, and how programs are compiled, counted and stored."""
