"""`ReplicaSet`: `dp` independent engine replicas behind the one `EngineCore` interface.

With `--mesh dp=2,tp=4` each replica is a full `EngineCore` on its own 4 devices, with its own
KV pages, scheduler, prefix cache and compiled programs; the weights are read from disk once and
placed on every replica's devices. A new request goes to the replica whose prefix cache holds
the longest part of its prompt, unless that replica is much busier than the least-loaded one
(load: prompt + remaining output tokens of its unfinished requests), and stays there. One
`ReplicaSet.step()` steps every replica that has work, each in its own worker thread: a step
spends most of its time in XLA (which releases the GIL), so the replicas' devices run at the
same time. Each replica is still stepped by one thread at a time, as `EngineCore` requires.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import jax

from jengine.config import EngineConfig
from jengine.core.build import open_model, resolve_backends
from jengine.core.contract import CoreContract, ProgramReport
from jengine.core.engine_core import EngineCore
from jengine.core.request import RequestState
from jengine.core.startup import model_dtype
from jengine.core.stats import EngineStats
from jengine.outputs import RequestOutput
from jengine.sharding import MeshSpec


def choose_replica(cached: list[int], loads: list[int], slack: int) -> int:
    """Cache-aware routing: among the replicas that are not much busier than the least-loaded
    one (load at most 1.5x its load plus `slack` tokens), the one with the most cached prompt
    tokens; the least loaded of those on a tie (so with nothing cached, the least loaded).
    Small load differences are worth a cache hit (a hit skips prefill); large ones are not."""
    bound = 1.5 * min(loads) + slack
    candidates = [i for i in range(len(loads)) if loads[i] <= bound]
    return max(candidates, key=lambda i: (cached[i], -loads[i], -i))


def make_core(cfg: EngineConfig, *, progress: bool = True, warmup: bool = True,
              require_warm: bool = False) -> CoreContract:
    """One EngineCore, or a ReplicaSet when the mesh asks for dp > 1."""
    spec = MeshSpec.parse(cfg.parallel.mesh)
    if spec.dp == 1:
        return EngineCore(cfg, progress=progress, warmup=warmup, require_warm=require_warm)
    if cfg.parallel.num_processes > 1:
        raise ValueError("dp > 1 across several processes is not supported yet; use tp")
    return ReplicaSet(cfg, progress=progress, warmup=warmup, require_warm=require_warm)


class ReplicaSet:
    """Data-parallel replicas behind the engine contract (`jengine.core.contract`), which
    Engine and the server use."""

    def __init__(self, cfg: EngineConfig, *, progress: bool = True, warmup: bool = True,
                 require_warm: bool = False):
        spec = MeshSpec.parse(cfg.parallel.mesh)
        spec.check_devices()  # before any weight is read
        # `auto` resolved once, for the weights read here and every replica's programs alike.
        backend = resolve_backends(cfg.model, jax.default_backend(), spec.tp)["matmul_backend"]
        dtype = model_dtype(cfg, None, backend)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))
        loaded = open_model(cfg.model, dtype, cfg.model.quantization, progress)
        self.replicas: list[EngineCore] = [
            EngineCore(cfg, progress=progress, replica=r, loaded=loaded, warmup=warmup,
                       require_warm=require_warm)
            for r in range(spec.dp)
        ]
        first = self.replicas[0]
        self.cfg, self.model, self.tokenizer = first.cfg, first.model, first.tokenizer
        self._owner: dict[str, EngineCore] = {}
        self.assigned = [0] * spec.dp  # requests sent to each replica so far
        self._pool = ThreadPoolExecutor(spec.dp, thread_name_prefix="jengine-replica")

    # -- what every replica shares ------------------------------------------------------------

    @property
    def grammars(self):
        return self.replicas[0].grammars

    def encode_prompt(self, prompt):
        return self.replicas[0].encode_prompt(prompt)

    # -- across replicas ---------------------------------------------------------------------

    @property
    def warmup_seconds(self) -> float:
        return sum(r.warmup_seconds for r in self.replicas)

    @property
    def num_steps(self) -> int:
        return max(r.num_steps for r in self.replicas)

    @property
    def host_seconds(self) -> float:
        return max(r.host_seconds for r in self.replicas)

    @property
    def device_seconds(self) -> float:
        return max(r.device_seconds for r in self.replicas)

    @property
    def compiles_since_ready(self) -> int:
        return sum(r.compiles_since_ready for r in self.replicas)

    @property
    def has_unfinished(self) -> bool:
        return any(r.has_unfinished for r in self.replicas)

    # -- requests -----------------------------------------------------------------------------

    @staticmethod
    def load(core: EngineCore) -> int:
        """Outstanding tokens of a replica: prompts plus the output still to come."""
        return sum(
            len(state.prompt_ids)
            + sum(s.seq.max_tokens - len(s.seq.output_ids) for s in state.samples)
            for state in list(core.requests.values())
        )

    def stats(self) -> EngineStats:
        return EngineStats.total([r.stats() for r in self.replicas])

    def add_request(self, request_id: str, prompt, params, *args, **kwargs) -> RequestState:
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        index = self.route(prompt)
        core = self.replicas[index]
        state = core.add_request(request_id, prompt, params, *args, **kwargs)
        self._owner[request_id] = core
        self.assigned[index] += 1
        return state

    def route(self, prompt) -> int:
        """The replica a new request with this prompt goes to (see `choose_replica`)."""
        loads = [self.load(r) for r in self.replicas]
        cached = [0] * len(self.replicas)
        if self.cfg.cache.enable_prefix_caching:
            try:
                _, ids = self.encode_prompt(prompt)  # encoded again by the chosen replica
            except ValueError:
                return 0  # add_request reports it
            cached = [r.prefix_cache.match_length(ids) for r in self.replicas]
        return choose_replica(cached, loads, self.cfg.scheduler.max_num_batched_tokens)

    def encode_images(self, prompt):
        return self.replicas[0].encode_images(prompt)  # where `route` sends image prompts

    def add_lora(self, lora_request):
        for replica in self.replicas:
            replica.add_lora(lora_request)
        return lora_request

    def remove_lora(self, lora_id: int) -> None:
        for replica in self.replicas:
            replica.remove_lora(lora_id)

    def abort(self, request_id: str) -> RequestOutput | None:
        core = self._owner.pop(request_id, None)
        return core.abort(request_id) if core is not None else None

    def reset_prefix_cache(self) -> int:
        return sum(r.reset_prefix_cache() for r in self.replicas)

    def follow(self) -> int:
        raise RuntimeError("data-parallel replicas run in one process; nothing follows them")

    def program_reports(self) -> list[ProgramReport]:
        return [r.program_reports()[0] for r in self.replicas]

    def step(self) -> list[RequestOutput]:
        """One step of every replica with work, concurrently; their deltas together."""
        busy = [r for r in self.replicas if r.has_unfinished]
        outputs: list[RequestOutput] = []
        for part in self._pool.map(EngineCore.step, busy):
            outputs.extend(part)
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs
