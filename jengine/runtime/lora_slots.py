"""`LoraSlots`: the device slots that hold the adapters a step may use, and which is where.

Per layer and target projection the slots are `a` [I, N, R] and `b` [N, R, O]
(`jengine.models.lora`; I and O the projection's flattened input and output), N =
`max_loras`, zero where a slot is empty or an adapter does not target that projection, so
every step program has one fixed shape whatever the adapters. An
adapter is copied into a slot between steps (`ensure`) by one program compiled when the slots
are made, with the slot index as data: filling or swapping a slot never compiles. A step
already in flight keeps reading the arrays it was launched with (JAX arrays are immutable; a
fill makes new ones). Slots are reused least recently used first, never one the batch being
launched needs.

A plain-sampling step computes only the slots its batch uses, rounded up to a width (`widths`:
powers of two below `max_loras`, and `max_loras`): each width is its own program variant,
built at warm-up, and a step narrower than all slots gathers the ones it uses (`pick_slots`)
and numbers its tokens by their place among them. Steps with sampling features or prompt
logprobs (rarer under adapters) compute every slot, which keeps warm-up at 3 + 3 +
(widths - 1) programs per bucket instead of 3 x (widths + 1). The update's cost follows the
distinct adapters in the batch, not the slots configured, and still nothing compiles after
ready.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jengine.models import ModelConfig, family_module
from jengine.models.lora import slot_axes, target_shapes
from jengine.scheduling.batch import ScheduledBatch
from jengine.sharding import ShardingRules

NO_SLOT = -1  # a token without an adapter

Tree = list[dict[str, dict[str, jax.Array]]]  # [layer][target]{"a", "b"}


class LoraSlots:
    """`max_loras` adapter slots of rank `max_rank` on the devices, and the id in each."""

    def __init__(self, cfg: ModelConfig, dtype, *, max_loras: int, max_rank: int,
                 rules: ShardingRules | None = None):
        if max_loras < 1 or max_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        specs = family_module(cfg).param_specs(cfg)
        self.shapes = target_shapes(specs)
        self.max_loras, self.max_rank, self.dtype = max_loras, max_rank, jnp.dtype(dtype)
        self.num_layers = cfg.num_layers
        n, r = max_loras, max_rank
        shardings = None
        if rules is not None:
            shardings = [{t: {k: rules.sharding(ax) for k, ax in zip("ab", slot_axes(specs, t))}
                          for t in self.shapes} for _ in range(cfg.num_layers)]

        def zeros() -> Tree:
            return [{t: {"a": jnp.zeros((math.prod(ins), n, r), self.dtype),
                         "b": jnp.zeros((n, r, math.prod(outs)), self.dtype)}
                     for t, (ins, outs) in self.shapes.items()} for _ in range(self.num_layers)]

        self.tree: Tree = jax.jit(zeros, out_shardings=shardings)()

        def fill(tree: Tree, slot: jax.Array, weights: Tree) -> Tree:
            return [{t: {"a": s["a"].at[:, slot].set(w[t]["a"].astype(s["a"].dtype)),
                         "b": s["b"].at[slot].set(w[t]["b"].astype(s["b"].dtype))}
                     for t, s in layer.items()} for layer, w in zip(tree, weights)]

        # Host weights go in replicated under a mesh; the fill leaves each shard its slice.
        self._in_sharding = rules.replicated() if rules is not None else None
        one = [{t: {"a": jax.ShapeDtypeStruct((math.prod(ins), r), np.float32,
                                              sharding=self._in_sharding),
                    "b": jax.ShapeDtypeStruct((r, math.prod(outs)), np.float32,
                                              sharding=self._in_sharding)}
                for t, (ins, outs) in self.shapes.items()} for _ in range(self.num_layers)]
        index = jax.ShapeDtypeStruct((), np.int32, sharding=self._in_sharding)
        # Compiled now, before any step: a fill while serving runs it with new data only.
        self._fill = jax.jit(fill, out_shardings=shardings).lower(self.tree, index,
                                                                   one).compile()
        # The slot counts a step program computes (Variant.lora_width): 1, 2, 4, ... N.
        self.widths = tuple(sorted({min(2 ** i, n) for i in range(n.bit_length() + 1)}))
        self.ids: list[int | None] = [None] * max_loras  # adapter id in each slot
        self._last_use = [0] * max_loras
        self._clock = itertools.count(1)

    def token_slots(self, lora_ids: np.ndarray, q_lens: np.ndarray,
                    narrow: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
        """Each token's slot for the step, and the slots the step computes (every slot when
        not `narrow`: the features and prompt-logprobs programs have no narrow variants).

        Returns:
          ([num_tokens] int32 each token's place among the computed slots, `NO_SLOT` for id 0;
          [W] int32 the slots to gather, W the narrowest of `widths` that holds the batch's
          adapters, or None when W is `max_loras`: every slot, in place). Every nonzero id
          must be resident (`ensure` first).
        """
        slot_of = {i: s for s, i in enumerate(self.ids) if i is not None}
        per_seq = [slot_of[i] if i else NO_SLOT for i in lora_ids.tolist()]
        used = sorted({s for s in per_seq if s != NO_SLOT})
        width = next(w for w in self.widths if w >= len(used)) if narrow else self.max_loras
        pick = None
        if width < self.max_loras:
            place = {s: k for k, s in enumerate(used)}
            per_seq = [place.get(s, NO_SLOT) for s in per_seq]
            pick = np.asarray(used + [0] * (width - len(used)), np.int32)  # padding: unread
        return np.repeat(np.asarray(per_seq, np.int32), q_lens), pick

    def ensure(self, lora_ids: set[int], host: Callable[[int], list[dict]]) -> int:
        """Puts every adapter of `lora_ids` (nonzero) in a slot, copying in from `host(id)`
        (per layer {target: (a [*in, r], b [r, *out])}) those that are not. Returns how many
        were copied.

        Raises:
          ValueError: more distinct adapters than slots (the scheduler admits no such batch).
        """
        wanted = {i for i in lora_ids if i}
        if len(wanted) > self.max_loras:
            raise ValueError(f"{len(wanted)} adapters in one step; max_loras is "
                             f"{self.max_loras}")
        now = next(self._clock)
        copied = 0
        for lora_id in sorted(wanted):
            if lora_id in self.ids:
                self._last_use[self.ids.index(lora_id)] = now
                continue
            free = [s for s in range(self.max_loras) if self.ids[s] not in wanted]
            slot = min(free, key=lambda s: (self.ids[s] is not None, self._last_use[s]))
            weights, index = self._padded(host(lora_id)), np.int32(slot)
            if self._in_sharding is not None:
                weights, index = jax.device_put((weights, index), self._in_sharding)
            self.tree = self._fill(self.tree, index, weights)
            self.ids[slot], self._last_use[slot] = lora_id, now
            copied += 1
        return copied

    def evict(self, lora_id: int) -> None:
        """Forgets an adapter's slot (its weights stay until the slot is filled again)."""
        if lora_id in self.ids:
            self.ids[self.ids.index(lora_id)] = None

    def _padded(self, layers: list[dict]) -> list[dict[str, dict[str, np.ndarray]]]:
        """One adapter's host weights at the slots' shapes: rank padded with zeros, zeros
        for the projections it does not target."""
        r = self.max_rank
        out = []
        for i in range(self.num_layers):
            given = layers[i] if i < len(layers) else {}
            layer = {}
            for t, (ins, outs) in self.shapes.items():
                a = np.zeros((math.prod(ins), r), np.float32)
                b = np.zeros((r, math.prod(outs)), np.float32)
                if t in given:
                    ga, gb = given[t]  # [*in, rank], [rank, *out]
                    a[:, : ga.shape[-1]] = ga.reshape(a.shape[0], -1)
                    b[: gb.shape[0]] = gb.reshape(gb.shape[0], -1)
                layer[t] = {"a": a, "b": b}
            out.append(layer)
        return out


def with_slots(params: dict, tree: Tree) -> dict:
    """`params` with layer i's adapter slots `tree[i]` under its "lora" key (traced in the
    step): in each per-layer dict (unstacked layers), else stacked over layers for the scan."""
    if "layers" in params:
        return {**params, "layers": tuple({**p, "lora": slots}
                                          for p, slots in zip(params["layers"], tree))}
    return {**params, "lora": jax.tree.map(lambda *xs: jnp.stack(xs), *tree)}


def pick_slots(tree: Tree, pick: jax.Array) -> Tree:
    """The slots `pick` [W] names, gathered (traced in a step narrower than all slots):
    per target `a` [I, W, R] and `b` [W, R, O]."""
    return [{t: {"a": jnp.take(s["a"], pick, axis=1, mode="clip"),
                 "b": jnp.take(s["b"], pick, axis=0, mode="clip")} for t, s in layer.items()}
            for layer in tree]


def batch_slots(loras: LoraSlots | None, batch: ScheduledBatch,
                narrow: bool = True) -> tuple[np.ndarray, np.ndarray | None] | None:
    """For a batch with adapters (theirs resident), `LoraSlots.token_slots`: each token's
    slot and the slots the step gathers; else None.

    Raises:
      ValueError: the batch has adapters and the engine no slots (`enable_lora` off).
    """
    if batch.lora_ids is None:
        return None
    if loras is None:
        raise ValueError("a batch with LoRA adapters on an engine without enable_lora")
    return loras.token_slots(batch.lora_ids, batch.q_lens, narrow)
