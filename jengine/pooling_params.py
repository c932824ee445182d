"""`PoolingParams`: an embedding request's options, what it carries where a generation request
carries `SamplingParams` (vLLM's name). A value type of the base layer, so that the server and
the engine share it without either reaching into the core (jengine/core/pooling.py pools)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """One embedding request's options (vLLM's `PoolingParams`): what `Engine.embed` and the
    embedding routes submit instead of `SamplingParams`.

    Attributes:
      dimensions: keep the first this many values (a Matryoshka model only), then normalise
        again if the engine normalises; None: the full width.
      truncate_prompt_tokens: keep only the last this many input tokens (None: an input over
        the context is a ValueError).
    """

    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    n = 1  # one vector per input (the server's request books count samples)

    def __post_init__(self):
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
