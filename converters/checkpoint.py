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
from jengine.models import ModelConfig, family_module

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


def load_checkpoint(
    path: str | Path, dtype: str = "float32", shardings=None, *, restore: bool = True
) -> LoadedModel:
    """Restores a converted checkpoint; arrays land on `shardings` when given (else device 0).
    With `restore=False` only the config and tokenizer load (params stay `{}`), for
    `restore_params` to place later."""
    from transformers import AutoTokenizer

    path = Path(path).resolve()
    meta = _read_meta(path)
    cfg = ModelConfig.from_dict(meta["config"])
    params = restore_params(path, cfg, shardings, dtype) if restore else {}
    tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"))
    return LoadedModel(
        cfg, dict(params), tokenizer, str(path), "checkpoint", meta.get("generation_config", {})
    )


def restore_params(
    path: str | Path, cfg: ModelConfig, shardings=None, dtype: str = "float32"
) -> dict[str, jax.Array]:
    """Restores the params of `cfg` straight onto `shardings` (each device reads its own slice).

    `cfg` may be the checkpoint's config with q heads padded for tp (`padded_config`): stored
    arrays then restore into the larger shape with the padding zero-filled by Orbax
    (`strict=False`), so no host copy of any weight is made either way.

    Raises:
      ModelLoadError: a param is missing or stored with another shape than the checkpoint's
        config declares, or the restore fails.
    """
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    specs = family_module(cfg).param_specs(cfg)
    stored = _stored_shapes(path, specs)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {
        name: jax.ShapeDtypeStruct(spec.shape, numpy_dtype(dtype),
                                   sharding=shardings[name] if shardings else device)
        for name, spec in specs.items()
    }
    args = {  # strict=False: Orbax zero-fills a target larger than the stored array
        name: ocp.ArrayRestoreArgs(sharding=t.sharding, global_shape=t.shape, dtype=t.dtype,
                                   strict=t.shape == stored[name])
        for name, t in target.items()
    }
    try:
        with ocp.PyTreeCheckpointer() as ckpt:
            restore = ocp.args.PyTreeRestore(item=target, restore_args=args)
            return dict(ckpt.restore(path / "params", args=restore))
    except Exception as e:
        raise ModelLoadError(f"cannot restore params from {path / 'params'}: {e}") from e


def _stored_shapes(path: Path, specs: dict) -> dict[str, tuple[int, ...]]:
    """The stored shape of every param in `specs` (which may be padded for tp).

    Raises:
      ModelLoadError: a param is missing, or stored with another shape than the checkpoint's own
        config declares.
    """
    import orbax.checkpoint as ocp

    stored_cfg = ModelConfig.from_dict(_read_meta(path)["config"])
    declared = family_module(stored_cfg).param_specs(stored_cfg)
    try:
        with ocp.PyTreeCheckpointer() as ckpt:
            tree = ckpt.metadata(path / "params").item_metadata.tree
        stored = {name: tuple(meta.shape) for name, meta in tree.items()}
    except Exception as e:
        raise ModelLoadError(f"cannot read params metadata from {path / 'params'}: {e}") from e
    missing = sorted(set(specs) - set(stored))
    if missing:
        raise ModelLoadError(f"checkpoint is missing weights for {', '.join(missing)}")
    for name, spec in specs.items():
        if stored[name] != declared[name].shape:
            raise ModelLoadError(f"checkpoint param {name} has shape {stored[name]}; expected "
                                 f"{declared[name].shape}")
        if any(t < s for t, s in zip(spec.shape, stored[name], strict=True)):
            raise ValueError(f"cannot restore {name} {stored[name]} into {spec.shape}")
    return stored


def _read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / CHECKPOINT_MARKER).read_text())
        ModelConfig.from_dict(meta["config"])
    except Exception as e:
        raise ModelLoadError(f"corrupt jengine checkpoint {path}: {e}") from e
    return meta
