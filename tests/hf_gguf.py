"""The test oracle's side of a GGUF: HF transformers' tokenizer and float32 model for one file.

transformers builds a new `gguf.GGUFReader` for the tokenizer, for the config and for the weights:
three parses of the whole file, each walking every vocabulary string one memmap view at a time
(some 15 s apiece for Gemma 3's 262k-token vocabulary). What transformers computes does not
depend on how many times it reads the file, so `load_hf_gguf` hands it one reader for all three.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path


def load_hf_gguf(path: Path):
    """(AutoTokenizer, AutoModelForCausalLM in float32, eval mode) for the GGUF file `path`."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    real = gguf.GGUFReader
    gguf.GGUFReader = functools.cache(real)  # transformers imports it from gguf at each call
    try:
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
    finally:
        gguf.GGUFReader = real
    return tok, model


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one thread, for while a jengine subprocess runs alongside: OpenMP barriers with
    more threads than free cores make each matmul wait out whole scheduler time slices (~50x
    slower)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
