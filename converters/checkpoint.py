"""jengine's converted checkpoint: an Orbax param tree + config + tokenizer in one directory.

Layout:
  OUT/jengine_model.json   model config (ModelConfig.to_dict), source, generation config
  OUT/params/              Orbax StandardCheckpointer tree: {param name: array}
  OUT/tokenizer/           tokenizer.json, tokenizer_config.json (with the chat template)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np

from converters.errors import ModelLoadError
from converters.source import CHECKPOINT_MARKER, LoadedModel, numpy_dtype
from jengine.models import ModelConfig

FORMAT_VERSION = 1


def save_checkpoint(model: LoadedModel, out: str | Path, *, overwrite: bool = False) -> Path:
    """Writes `model` to `out` (which must not exist unless `overwrite`)."""
    import orbax.checkpoint as ocp

    out = Path(out).resolve()
    if out.exists():
        if not overwrite:
            raise ModelLoadError(f"output directory {out} already exists")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    meta = {
        "format_version": FORMAT_VERSION,
        "config": model.config.to_dict(),
        "source": model.source,
        "generation_config": model.generation_config,
        "dtype": str(next(iter(model.params.values())).dtype),
    }
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(out / "params", {k: np.asarray(v) for k, v in model.params.items()})
        ckpt.wait_until_finished()
    model.tokenizer.save_pretrained(str(out / "tokenizer"))
    (out / CHECKPOINT_MARKER).write_text(json.dumps(meta, indent=1))
    return out


def load_checkpoint(path: str | Path, dtype: str = "float32", shardings=None) -> LoadedModel:
    """Restores a converted checkpoint; arrays land on `shardings` when given (else device 0)."""
    import orbax.checkpoint as ocp
    from transformers import AutoTokenizer

    path = Path(path).resolve()
    try:
        meta = json.loads((path / CHECKPOINT_MARKER).read_text())
        cfg = ModelConfig.from_dict(meta["config"])
    except Exception as e:
        raise ModelLoadError(f"corrupt jengine checkpoint {path}: {e}") from e
    from jengine.models import family_module

    specs = family_module(cfg).param_specs(cfg)
    target_dtype = numpy_dtype(dtype)
    device = jax.devices()[0]
    abstract = {
        name: jax.ShapeDtypeStruct(
            spec.shape, target_dtype,
            sharding=shardings[name] if shardings else jax.sharding.SingleDeviceSharding(device),
        )
        for name, spec in specs.items()
    }
    try:
        with ocp.StandardCheckpointer() as ckpt:
            params = ckpt.restore(path / "params", abstract)
    except Exception as e:
        raise ModelLoadError(f"cannot restore params from {path / 'params'}: {e}") from e
    tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"))
    return LoadedModel(
        cfg, dict(params), tokenizer, str(path), "checkpoint", meta.get("generation_config", {})
    )
