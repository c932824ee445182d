"""Embedding tasks on the host: how a model's final hidden states become one vector per input.

An embedding request is a prefill whose step returns the final hidden state of every token
(after the final norm, `runtime.step_io.Variant.embed`); the rows of each chunk are folded into
the request's `PooledState` as they come back, so chunked prefill and a restart after
preemption (positions from 0 again) pool the same rows as one pass would. When the last chunk
lands the request finishes and keeps no KV pages.

`Pooling` is the engine's setting, read once at start: the `--pooling` / `--no-normalize`
flags, else the model directory's sentence-transformers files (`modules.json` listing a
`Pooling` module with `1_Pooling/config.json`, and a `Normalize` module or not), else the last
token, normalised (what decoder embedding models such as Qwen3-Embedding use). Matryoshka
sizes come from `config.json`'s `matryoshka_dimensions` (a list) or `is_matryoshka: true`
(any size up to the width), the keys vLLM reads.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jengine.pooling_params import PoolingParams

TASKS = ("generate", "embed", "score")
POOLING_METHODS = ("last", "mean", "cls")

# 1_Pooling/config.json's flag -> our method; the others (max, weighted mean) are not served.
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "cls"}


@dataclasses.dataclass(frozen=True)
class Pooling:
    """The engine's pooling: `method` over the prompt's tokens, then an optional L2 norm."""

    method: str = "last"
    normalize: bool = True
    hidden_size: int = 0
    matryoshka: tuple[int, ...] | None = None  # sizes `dimensions` may take; None: none

    def check(self, params: PoolingParams) -> None:
        """Raises ValueError when this model cannot honour `params.dimensions`."""
        d = params.dimensions
        if d is None or d == self.hidden_size:
            return
        if self.matryoshka is None:
            raise ValueError(f"this model does not support matryoshka dimensions: "
                             f"dimensions must be omitted or {self.hidden_size}")
        if d not in self.matryoshka:
            raise ValueError(f"dimensions must be one of {list(self.matryoshka)}, got {d}")

    def finish(self, vector: np.ndarray, params: PoolingParams) -> list[float]:
        """A pooled [E] f32 vector -> the request's answer (cut to its dimensions, normed)."""
        if params.dimensions is not None:
            vector = vector[: params.dimensions]
        if self.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
        return vector.astype(np.float32).tolist()


def resolve_pooling(task: str, method: str | None, normalize: bool | None,
                    model_dir: str | None, hidden_size: int) -> Pooling | None:
    """The engine's `Pooling` (None for `task="generate"`); flags win over the model's files.

    Raises:
      ValueError: an unknown task or method, or a model whose files ask for a pooling this
        engine does not run (and no `method` overrides it).
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if task == "generate":
        if method is not None or normalize is not None:
            raise ValueError("pooling and normalize apply to task 'embed' or 'score' only")
        return None
    if method is not None and method not in POOLING_METHODS:
        raise ValueError(f"pooling must be one of {POOLING_METHODS}, got {method!r}")
    found_method, found_norm = _sentence_transformers(Path(model_dir) if model_dir else None)
    if method is None and found_method is None and found_norm is not None:
        raise ValueError(f"{model_dir}: its sentence-transformers pooling is not one of "
                         f"{POOLING_METHODS}; pass pooling explicitly")
    return Pooling(method=method or found_method or "last",
                   normalize=normalize if normalize is not None else (
                       found_norm if found_norm is not None else True),
                   hidden_size=hidden_size,
                   matryoshka=_matryoshka(Path(model_dir) if model_dir else None, hidden_size))


def _sentence_transformers(root: Path | None) -> tuple[str | None, bool | None]:
    """(pooling method, normalise) from a sentence-transformers model dir; (None, None) when
    it has no modules.json (and a None method when its pooling is not one we run)."""
    if root is None or not (root / "modules.json").is_file():
        return None, None
    modules = json.loads((root / "modules.json").read_text())
    types = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    method = None
    if "Pooling" in types:
        config = root / types["Pooling"].get("path", "1_Pooling") / "config.json"
        if config.is_file():
            flags = json.loads(config.read_text())
            on = [ours for key, ours in _ST_MODES.items() if flags.get(key)]
            others = [k for k, v in flags.items()
                      if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
            method = on[0] if len(on) == 1 and not others else None
    return method, "Normalize" in types


def _matryoshka(root: Path | None, hidden_size: int) -> tuple[int, ...] | None:
    if root is None or not (root / "config.json").is_file():
        return None
    config = json.loads((root / "config.json").read_text())
    dims = config.get("matryoshka_dimensions")
    if dims:
        return tuple(sorted(int(d) for d in dims if 0 < int(d) <= hidden_size))
    if config.get("is_matryoshka"):
        return tuple(range(1, hidden_size + 1))
    return None


class PooledState:
    """One request's running pool over the hidden rows its prefill chunks returned."""

    def __init__(self, method: str, prompt_len: int, params: PoolingParams):
        self.method = method
        self.prompt_len = prompt_len
        self.params = params
        self._sum: np.ndarray | None = None  # mean: float64 sum of the rows so far
        self._vector: np.ndarray | None = None  # cls / last: the chosen row

    def add(self, positions: np.ndarray, rows: np.ndarray) -> None:
        """Folds in one chunk: `positions` [n] of its tokens, `rows` [n, E] f32 hidden."""
        if self.method == "mean":
            if positions[0] == 0:  # the first chunk, or a restart after preemption
                self._sum = np.zeros(rows.shape[1], np.float64)
            self._sum += rows.sum(axis=0, dtype=np.float64)
            return
        target = 0 if self.method == "cls" else self.prompt_len - 1
        hit = np.flatnonzero(positions == target)
        if hit.size:
            self._vector = rows[hit[0]].astype(np.float32)

    def vector(self) -> np.ndarray:
        """The pooled [E] f32 vector once every chunk is in."""
        if self.method == "mean":
            return (self._sum / self.prompt_len).astype(np.float32)
        return self._vector
