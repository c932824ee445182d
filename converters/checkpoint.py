"""jengine's converted checkpoint: an Orbax param tree + config + tokenizer in one directory.

Layout:
  OUT/jengine_model.json   model config (ModelConfig.to_dict), source, generation config,
                           quantization of the stored weights (none | int8 | w8a16)
  OUT/params/              Orbax StandardCheckpointer tree: {param name: array}; a quantized
                           weight is {"q": int8 array, "scale": float32 per-channel scales}
  OUT/tokenizer/           tokenizer.json, tokenizer_config.json (with the chat template)
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np

from converters.errors import ModelLoadError
from converters.loaded import CHECKPOINT_MARKER, LoadedModel, numpy_dtype
from converters.quiet_transformers import import_transformers
from jengine.models import ModelConfig, family_module
from jengine.models.quant import (
    QArray,
    quantize_weight,
    quantized_names,
    scale_shape,
    scale_sharding,
)
from jengine.models.smoothing import DEFAULT_ALPHA, smooth_for_int8
from jengine.pallas_kernels import resolve_backend

FORMAT_VERSION = 1


def save_checkpoint(model: LoadedModel, out: str | Path, *, overwrite: bool = False,
                    quantization: str = "none", quantize_lm_head: bool = False,
                    smoothing_alpha: float | None = None) -> Path:
    """Writes `model` to `out` (which must not exist unless `overwrite`).

    With `quantization` int8 or w8a16 the projections (and the lm_head with
    `quantize_lm_head`) are stored as int8 with their per-channel scales, about a quarter of
    their float32 bytes, and an engine restores them as they are: no float copy, no
    re-quantizing at start-up. The mode stored is the engine's default for the checkpoint.
    For `int8` the float weights are first smoothed (`jengine.models.smoothing`, with
    `smoothing_alpha`, None for the engine's default; 0 skips it), as an engine does when it
    quantizes at load time: the stored model is the same float model, with activation range
    moved into the weights.
    """
    if quantization not in ("none", "int8", "w8a16"):
        raise ValueError(f"cannot store quantization {quantization!r}; use none, int8 or w8a16")
    if model.quantization != "none":  # read as int8 (compressed-tensors): stored as read
        quantization = model.quantization if quantization == "none" else quantization
        smoothing_alpha = 0.0  # nothing float to smooth
        head = "embed" if model.config.tie_word_embeddings else "lm_head"
        quantize_lm_head = quantize_lm_head or isinstance(model.params.get(head), QArray)
    if smoothing_alpha is None:
        smoothing_alpha = DEFAULT_ALPHA
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
        "quantization": quantization,
        "quantize_lm_head": quantize_lm_head,
        "smoothing_alpha": smoothing_alpha if quantization == "int8" else 0.0,
    }
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(out / "params", _host_tree(model, quantization, quantize_lm_head,
                                             smoothing_alpha))
        ckpt.wait_until_finished()
    model.tokenizer.save_pretrained(str(out / "tokenizer"))
    (out / CHECKPOINT_MARKER).write_text(json.dumps(meta, indent=1))
    return out


def _host_tree(model: LoadedModel, quantization: str, lm_head: bool, alpha: float) -> dict:
    """The param tree to store: numpy arrays, quantized weights as {"q", "scale"} pairs
    (smoothed for int8 and quantized on the host's CPU device, with the engine's own
    functions)."""
    tree = {k: v if isinstance(v, QArray) else np.asarray(v) for k, v in model.params.items()}
    if quantization == "none":
        return tree
    cfg = model.config
    family = family_module(cfg)
    specs = family.param_specs(cfg)
    with jax.default_device(jax.devices("cpu")[0]):
        if quantization == "int8" and model.quantization == "none":  # float weights
            run_cfg = dataclasses.replace(cfg, attention_backend=resolve_backend("auto", "cpu"))
            smoothed = smooth_for_int8({k: jax.numpy.asarray(v) for k, v in tree.items()},
                                       run_cfg, family, model.tokenizer, alpha)
            tree = {k: np.asarray(v) for k, v in smoothed.items()}
        for name in quantized_names(specs, cfg.tie_word_embeddings, lm_head):
            qa = tree[name]
            if not isinstance(qa, QArray):
                qa = quantize_weight(qa, specs[name].contract, quantization)
            tree[name] = {"q": np.asarray(qa.q), "scale": np.asarray(qa.scale)}
    return tree


def load_checkpoint(
    path: str | Path, dtype: str = "float32", shardings=None, *, restore: bool = True
) -> LoadedModel:
    """Restores a converted checkpoint; arrays land on `shardings` when given (else device 0).
    With `restore=False` only the config and tokenizer load (params stay `{}`), for
    `restore_params` to place later."""
    import_transformers()
    from transformers import AutoTokenizer

    path = Path(path).resolve()
    meta = _read_meta(path)
    cfg = ModelConfig.from_dict(meta["config"])
    params = restore_params(path, cfg, shardings, dtype) if restore else {}
    tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"))
    return LoadedModel(
        cfg, dict(params), tokenizer, str(path), "checkpoint", meta.get("generation_config", {}),
        quantization=meta.get("quantization", "none"),
        weights_note=("int8 values and scales restored as stored"
                      if meta.get("quantization", "none") != "none" else "float"),
    )


def restore_params(
    path: str | Path, cfg: ModelConfig, shardings=None, dtype: str = "float32"
) -> dict[str, jax.Array]:
    """Restores the params of `cfg` straight onto `shardings` (each device reads its own slice).

    `cfg` may be the checkpoint's config with q heads padded for tp (`padded_config`): stored
    arrays then restore into the larger shape with the padding zero-filled by Orbax
    (`strict=False`), so no host copy of any weight is made either way. Quantized weights come
    back as `QArray`s of the stored mode, their scales sharded with their output channels.

    Raises:
      ModelLoadError: a param is missing or stored with another shape than the checkpoint's
        config declares, or the restore fails.
    """
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    specs = family_module(cfg).param_specs(cfg)
    stored = _stored_shapes(path, specs)
    meta = _read_meta(path)
    mode = meta.get("quantization", "none")
    quantized = set() if mode == "none" else set(
        quantized_names(specs, cfg.tie_word_embeddings, meta.get("quantize_lm_head", False)))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target, args = {}, {}
    for name, spec in specs.items():
        sharding = shardings[name] if shardings else device
        if name not in quantized:
            target[name], args[name] = _target(spec.shape, numpy_dtype(dtype), sharding,
                                               stored[name])
            continue
        contract = spec.contract
        scales = (scale_sharding(sharding, len(spec.shape), contract)
                  if isinstance(sharding, jax.sharding.NamedSharding) else sharding)
        q = _target(spec.shape, np.dtype(np.int8), sharding, stored[name])
        scale = _target(scale_shape(spec.shape, contract), np.dtype(np.float32), scales,
                        scale_shape(stored[name], contract))
        target[name] = {"q": q[0], "scale": scale[0]}
        args[name] = {"q": q[1], "scale": scale[1]}
    try:
        with ocp.PyTreeCheckpointer() as ckpt:
            restore = ocp.args.PyTreeRestore(item=target, restore_args=args)
            params = dict(ckpt.restore(path / "params", args=restore))
    except Exception as e:
        raise ModelLoadError(f"cannot restore params from {path / 'params'}: {e}") from e
    for name in quantized:
        params[name] = QArray(q=params[name]["q"], scale=params[name]["scale"], mode=mode)
    return params


def _target(shape, dtype, sharding, stored_shape):
    """(restore target, Orbax restore args) of one array; strict=False lets Orbax zero-fill a
    target larger than the stored array (q heads padded for tp)."""
    import orbax.checkpoint as ocp

    target = jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)
    return target, ocp.ArrayRestoreArgs(sharding=sharding, global_shape=target.shape,
                                        dtype=dtype, strict=target.shape == tuple(stored_shape))


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
        # A quantized weight is stored as {"q", "scale"}: its shape is q's.
        stored = {name: tuple((meta["q"] if isinstance(meta, dict) else meta).shape)
                  for name, meta in tree.items()}
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
