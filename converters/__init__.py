"""Weights in, jengine param trees (name -> array dicts) out: HF safetensors, GGUF and converted
(Orbax) checkpoints.

`load_source(path)` reads any of the three into a `LoadedModel` (config, host param arrays in
jengine's layout, tokenizer); `save_checkpoint` writes the converted form `jengine convert` makes.
`load_source(path, lazy=True)` reads no weight yet: `load_params_sharded` (converters.placement)
then reads each device's slice on its own (safetensors slices, Orbax restore onto the shardings).
"""

from converters.errors import ModelLoadError
from converters.loaded import LoadedModel
from converters.placement import load_params_sharded
from converters.source import load_config, load_source

__all__ = ["LoadedModel", "ModelLoadError", "load_config", "load_params_sharded", "load_source"]
