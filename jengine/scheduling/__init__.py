"""Host-side scheduling: sequences, the continuous-batching scheduler, the page allocator,
the prefix cache and the speculative proposer. Plain Python and NumPy: nothing here imports
JAX (tests/base/test_config.py walks the imports to keep it so), so it is tested without
compiling."""
