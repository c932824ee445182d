"""jengine's public engine API: `Engine` (blocking) and `AsyncEngine` (asyncio, own thread;
jengine/async_engine.py, re-exported here).

The data flow of one step, and the type at each boundary:

    Request (prompt ids, SamplingParams, grammar) EngineCore.add_request (core/admission.py)
                                                   -> Sequence(s), each with its own grammar
                                                   matcher when constrained
      -> Scheduler.schedule()                      host: decodes first, then prefill chunks
                                                   within the token budget; allocates KV pages;
                                                   preempts by recompute when pages run out
      -> ScheduledBatch                            host NumPy: tokens, positions, slots, q/kv
                                                   lens, page tables (jengine/scheduling/batch.py)
      -> StepMasks.build()                         host: allowed-token bitmask rows of the
                                                   constrained sequences (None if there are none)
      -> StepInputs (runtime/step_io.py)           host NumPy padded to a declared bucket, with
                                                   the sampler's rows (SamplingRows padded)
      -> Runner.launch()                           one device_put, dispatches without waiting
      -> step(params, kv_cache, StepInputs, previous tokens)
                                                   one jitted program: embed -> layers (paged
                                                   attention writes new K/V) -> last-token
                                                   logits -> sampler; kv_cache donated
      -> StepOutputs                               on device: sampled rows, and the tokens the
                                                   step launched after this one reads
      -> Scheduler.advance()                       while it runs: counts move on, each sampling
                                                   sequence gets a PENDING token, and (async
                                                   scheduling) step N+1 is scheduled and launched,
                                                   its PENDING tokens read on the device
      -> StepResult (Runner.fetch)                 [S] token ids (+ logprobs) back to the host
      -> Scheduler.finalize()                      PENDING -> sampled token, eos/stop ids, free
                                                   pages of finished sequences; then each matcher
                                                   consumes its token (a complete grammar stops)
      -> IncrementalDetokenizer                    UTF-8 safe text deltas; stop strings cut
      -> RequestOutput deltas                      to Engine.generate / stream / AsyncEngine

An embedding engine (task embed / score) runs the same chain with `PoolingParams`: its steps
return every token's final hidden state instead of sampling (`StepResult.hidden`), the
postprocessor folds them into each request's `PooledState`, and the last chunk's delta carries
`RequestOutput.embedding`.

A sequence that stops on a token (EOS, stop id or string) may already be in the step launched
ahead; that row's result is dropped. Steps whose sampled sequences need their token on the host
before the next step (grammars, penalties) run one at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterator
from typing import Any

from jengine.async_engine import AsyncEngine
from jengine.config import EngineConfig, load_config
from jengine.core.kv_budget import host_kv_budget
from jengine.core.replicas import make_core
from jengine.core.request import merge_deltas
from jengine.core.stats import EngineStats
from jengine.lora_request import LoRARequest
from jengine.models.config import ModelConfig
from jengine.outputs import RequestOutput
from jengine.pooling_params import PoolingParams
from jengine.progress import progress_bar
from jengine.sampling_params import SamplingParams
from jengine.sharding import MeshSpec
from jengine.text.chat import render_chat, render_chat_text
from jengine.text.reasoning import resolve_format, split_reasoning, thinking_off
from jengine.text.tool_parsers import resolve_tool_parser, split_calls
from jengine.text.tools import constrain, tool_setup
from jengine.vision.chat import has_images, split_images
from jengine.vision.inputs import ImagePrompt

log = logging.getLogger("jengine")

# `from jengine.engine import AsyncEngine` keeps working: the asyncio front end has its own
# module now (jengine/async_engine.py), which imports nothing from this one.
__all__ = ["AsyncEngine", "Engine", "build_config", "check_kv_memory", "describe_auto_dtype"]

def build_config(model: str | None, config: str | None, **kwargs: Any) -> EngineConfig:
    """Engine kwargs (+ optional preset) -> EngineConfig. A keyword given (not None) always wins
    over the preset, even when it equals the default; the defaults themselves live only in the
    config dataclasses (`jengine.config`)."""
    return load_config(config, model=model, **kwargs)


def check_kv_memory(cfg: EngineConfig) -> None:
    """Raises ValueError when `cfg`'s `kv_cache_memory` cannot fit this host, from the config
    alone: a server checks it before it loads anything, so a wrong flag is a one-line error at
    start rather than one after the weights. Multi-host runs are skipped (each process must
    start JAX's backend itself, which this would do)."""
    if cfg.parallel.num_processes == 1:
        host_kv_budget(cfg.cache.kv_cache_memory, MeshSpec.parse(cfg.parallel.mesh), 1)


def describe_auto_dtype(config: ModelConfig) -> str:
    """What `dtype: auto` runs for a model of `config` on this machine with the default matmul
    backend, as an earlier start stored it (`jengine info`); measures nothing."""
    import jax

    from jengine.core import auto_dtype
    from jengine.models.matmul import resolve_matmul_backend
    from jengine.runtime.executables import default_store_dir

    backend = resolve_matmul_backend("auto", jax.default_backend(), 1)
    return auto_dtype.describe(config, backend, default_store_dir())


class Engine:
    """Offline inference: `generate`, `chat` and `stream` in the caller's thread."""

    def __init__(
        self,
        model: str | None = None,
        *,
        mesh: str | None = None,  # None: the preset's, else the config default ("tp=1")
        dtype: str | None = None,  # "auto"
        attention_backend: str | None = None,  # "auto"
        kv_cache_dtype: str | None = None,  # "auto"
        quantization: str | None = None,  # "none"
        quantize_lm_head: bool | None = None,  # False
        load_format: str | None = None,  # "auto" | "dummy" (random weights)
        speculative: str | None = None,  # None (off) | "ngram"
        num_speculative_tokens: int | None = None,  # 15 (ngram) | 3 (draft)
        draft_model: str | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,  # 64
        max_num_batched_tokens: int | None = None,  # 512
        page_size: int | None = None,  # 16
        kv_cache_memory: str | None = None,  # "2GiB"
        enable_prefix_caching: bool | None = None,  # True
        config: str | None = None,
        progress: bool = True,
        coordinator: str | None = None,
        num_processes: int | None = None,  # 1
        process_id: int | None = None,  # 0
        seed: int | None = None,
        task: str | None = None,  # "generate" | "embed" | "score"
        pooling: str | None = None,  # "last" | "mean" | "cls"; None: the model's files
        normalize: bool | None = None,  # None: the model's files, else True
        enable_lora: bool | None = None,  # False
        max_loras: int | None = None,  # 4
        max_lora_rank: int | None = None,  # 64
        max_cpu_loras: int | None = None,  # None: max_loras
        limit_mm_per_prompt: str | None = None,  # "image=4": images per prompt (vision models)
        warmup: bool = False,
    ):
        """`seed` makes the sampling of requests that set no seed of their own reproducible
        from one engine start to the next (vLLM's `seed`). `warmup=True` builds every bucket's
        step program up front (what a benchmark wants); by default each is built by the first
        step that needs it, so a few prompts load or compile only the buckets they use.

        `quantization` ("none" | "int8" | "w8a16" | "fp8" | "w4a16" | "auto") quantizes the
        projections at load time (jengine/models/quant.py, quant4.py; `auto` keeps a GGUF's
        4-bit or Q8_0 precision); an unknown mode, fp8 on CPU or w4a16 under tp is a ValueError.
        `quantize_lm_head=True` quantizes the output head (a tied embedding table) too.
        `load_format="dummy"` reads only the model's config and tokenizer and serves random
        weights of its shapes, made on the devices (vLLM's name): for timing a model whose
        weights are not at hand.

        `speculative="ngram"` proposes `num_speculative_tokens` tokens per decode by prompt
        lookup and verifies them in the same step (jengine/scheduling/speculative.py);
        `"draft"` has `draft_model` (same tokenizer) propose them greedily on its own engine
        core (jengine/core/draft.py). Either way outputs are those of plain decoding, greedy or
        sampled.

        Multi-host (`num_processes` > 1, one process per host, the same arguments on each
        but `process_id`): process 0 is the engine; on every other process this constructor
        runs process 0's step programs and returns only when process 0 exits.

        `task="embed"` (or `"score"`) makes an embedding engine: `embed` returns each text's
        final hidden states pooled by `pooling` ("last", "mean" or "cls") and L2-normalised
        unless `normalize=False`; the defaults come from a sentence-transformers model dir's
        modules.json (jengine/core/pooling.py). It refuses `generate`, as a generating engine
        refuses `embed`.

        `enable_lora=True` serves PEFT LoRA adapters over this model (docs/lora.md):
        `max_loras` adapters in one step (device slots of rank `max_lora_rank`),
        `max_cpu_loras` kept read on the host; `generate(..., lora_request=LoRARequest(name,
        int_id, path))` runs a request under one."""
        cfg = build_config(
            model, config, mesh=mesh, dtype=dtype, attention_backend=attention_backend,
            kv_cache_dtype=kv_cache_dtype, quantization=quantization,
            quantize_lm_head=quantize_lm_head, load_format=load_format, speculative=speculative,
            num_speculative_tokens=num_speculative_tokens,
            draft_model=draft_model, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, page_size=page_size,
            kv_cache_memory=kv_cache_memory, enable_prefix_caching=enable_prefix_caching,
            coordinator=coordinator, num_processes=num_processes, process_id=process_id,
            seed=seed, task=task, pooling=pooling, normalize=normalize, enable_lora=enable_lora,
            max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
            limit_mm_per_prompt=limit_mm_per_prompt,
        )
        self.core = make_core(cfg, progress=progress, warmup=warmup)
        if cfg.parallel.process_id != 0:
            self.core.follow()
        self.tokenizer = self.core.tokenizer
        self.progress = progress
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | dict | list[str | dict] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs in prompt order (tqdm bar on stderr).
        `lora_request`: the LoRA adapter every prompt runs under, or one per prompt (None:
        the base model); needs `enable_lora`. A prompt with images is vLLM's dict
        `{"prompt": text with one "<image>" per image, "multi_modal_data": {"image": image or
        [images]}}` (PIL images, uint8 arrays, image bytes or data: URLs), for a vision
        model."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts must be a non-empty string or list")
        prompts = [ImagePrompt.of(p) if isinstance(p, dict) else p for p in prompts]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError("need one SamplingParams per prompt")
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        if isinstance(lora_request, list):
            if len(lora_request) != len(prompts):
                raise ValueError("need one lora_request (or None) per prompt")
            loras = lora_request
        else:
            loras = [lora_request] * len(prompts)
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for p in params:  # distinct grammars compile in parallel on the grammar pool
            if isinstance(p, SamplingParams) and p.structured_outputs is not None:
                self.core.grammars.submit(p.structured_outputs)
        self._add_all(ids, prompts, params, loras)
        deltas: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
        bar = progress_bar(total=len(ids), desc="generating", enabled=self.progress, unit="req")
        pending = set(ids)
        while pending:
            for out in self.core.step():
                deltas[out.request_id].append(out)
                if out.finished:
                    pending.discard(out.request_id)
                    bar.update(1)
        bar.close()
        outputs = [merge_deltas(deltas[rid]) for rid in ids]
        for out in outputs:
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
        return outputs

    def _add_all(self, ids: list[str], prompts: list, params: list,
                 loras: list | None = None) -> None:
        """Queues every request, or none: a bad one's ValueError aborts those already added."""
        added = []
        loras = loras or [None] * len(ids)
        try:
            for rid, prompt, p, lora in zip(ids, prompts, params, loras):
                if lora is None:  # the plain call: a core without LoRA takes no such keyword
                    self.core.add_request(rid, prompt, p)
                else:
                    self.core.add_request(rid, prompt, p, lora_request=lora)
                added.append(rid)
        except ValueError:
            for rid in added:
                self.core.abort(rid)
            raise

    def embed(self, texts: str | list[int] | list[str | list[int]], *,
              dimensions: int | None = None,
              truncate_prompt_tokens: int | None = None) -> list[list[float]]:
        """One vector per text (a string or token ids), in order: the pooled final hidden
        states of an engine of task embed or score. `dimensions`: a Matryoshka model's
        shorter vectors; `truncate_prompt_tokens`: keep only each input's last this many
        tokens (else an input over the context is a ValueError).

        Raises:
          ValueError: bad input, or an engine that generates (task="generate").
        """
        if isinstance(texts, str) or (isinstance(texts, list) and texts
                                      and isinstance(texts[0], int)):
            texts = [texts]
        if not isinstance(texts, list) or not texts:
            raise ValueError("texts must be a non-empty string or list")
        params = PoolingParams(dimensions=dimensions,
                               truncate_prompt_tokens=truncate_prompt_tokens)
        ids = [f"embed-{next(self._ids)}" for _ in texts]
        self._add_all(ids, texts, [params] * len(ids))
        vectors: dict[str, list[float]] = {}
        while len(vectors) < len(ids):
            for out in self.core.step():
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                if out.finished:
                    vectors[out.request_id] = out.embedding
        return [vectors[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = True,
        reasoning_parser: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tool_call_parser: str | None = None,
        thinking_token_budget: int | None = None,
    ) -> list[RequestOutput]:
        """`generate` over the model's chat template applied to each conversation.

        With `tools` (OpenAI function tools) and `tool_choice` ('auto' by default, 'none',
        'required' or {'type': 'function', 'function': {'name': ...}}), each completion's calls
        come out parsed in `tool_calls` (its `text` keeps the rest) and a completion that made
        calls finishes with "tool_calls"; `parallel_tool_calls=False` allows one call under
        'required'. See `jengine.tools`. With `reasoning_parser` ('deepseek_r1', 'qwen3',
        'granite' or 'auto', the server's `--reasoning-parser`) the thinking goes to each
        completion's `reasoning`, and the tool calls and any output constraint are read from
        and applied to the answer after it (`jengine.text.reasoning`). `chat_template_kwargs`
        are extra template variables, e.g. `{"enable_thinking": False}`. `tool_call_parser`:
        the format of the model's own calls (`jengine.text.tool_parsers`; None: hermes;
        'auto': chosen from the model's chat template). `thinking_token_budget`: the most tokens
        the thinking may take before the end marker is forced (needs `reasoning_parser`;
        ignored when `chat_template_kwargs` turn thinking off; `after_reasoning.py`).
        """
        setup = tool_setup(tools, tool_choice, parallel_tool_calls)
        tool_call_parser = resolve_tool_parser(tool_call_parser,
                                               getattr(self.tokenizer, "chat_template", None))
        setup = dataclasses.replace(setup, fmt=tool_call_parser)  # forced calls: its format
        fmt = resolve_format(reasoning_parser, self.tokenizer, None, chat_template_kwargs)
        if thinking_token_budget is not None and fmt is None \
                and not thinking_off(chat_template_kwargs):
            raise ValueError("thinking_token_budget needs a reasoning_parser that finds a "
                             "reasoning format")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        shown = tools if setup.active else None
        prompts = [self.render_chat(c, tools=shown, template_kwargs=chat_template_kwargs)
                   for c in conversations]
        listed = isinstance(sampling_params, list)
        params = [constrain(p or SamplingParams(), setup)
                  for p in (sampling_params if listed else [sampling_params])]
        if fmt is not None:  # llguidance only where a constraint meets a reasoning format
            from jengine.structured.after_reasoning import params_after_reasoning

            params = [params_after_reasoning(p, fmt, self.tokenizer, thinking_token_budget)
                      for p in params]
        outputs = self.generate(prompts, params if listed else params[0])
        for out in outputs:
            for completion in out.outputs:
                if fmt is not None:
                    completion.reasoning, completion.text = split_reasoning(fmt, completion.text)
                if setup.active:
                    split_calls(completion, tool_call_parser,
                                forced=setup.constraint() is not None)
        return outputs

    def render_chat(self, messages: list[dict], *, tools: list[dict] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int] | ImagePrompt:
        """The conversation's prompt: token ids, or with image content parts (data: URLs,
        PIL images, uint8 arrays; `jengine.vision.chat`) the template's text and its images."""
        if has_images(messages):
            messages, images = split_images(messages)
            text = render_chat_text(self.tokenizer, messages, tools=tools,
                                    template_kwargs=template_kwargs)
            return ImagePrompt(text, tuple(images), add_special_tokens=False)
        return render_chat(self.tokenizer, messages, tools=tools, template_kwargs=template_kwargs)

    def stats(self) -> EngineStats:
        """Load and counters: requests, KV pages, preemptions, prefix-cache hits."""
        return self.core.stats()

    def stream(
        self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[RequestOutput]:
        """Yields deltas of one request as they are generated; the last has finished=True."""
        rid = f"stream-{next(self._ids)}"
        self._add_all([rid], [prompt], [sampling_params], [lora_request])
        try:
            while True:
                for out in self.core.step():
                    if out.request_id == rid:
                        if out.error is not None:
                            raise RuntimeError(f"request {rid} failed: {out.error}")
                        yield out
                        if out.finished:
                            return
        finally:
            self.core.abort(rid)
