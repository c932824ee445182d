"""Weights in, Flax param trees out: HF safetensors, GGUF and converted (Orbax) checkpoints.

`load_source(path)` reads any of the three into a `LoadedModel` (config, host param arrays in
jengine's layout, tokenizer); `save_checkpoint` writes the converted form `jengine convert` makes.
"""

from converters.errors import ModelLoadError
from converters.source import LoadedModel, load_config, load_source

__all__ = ["LoadedModel", "ModelLoadError", "load_config", "load_source"]
