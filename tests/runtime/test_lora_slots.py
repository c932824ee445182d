"""`LoraSlots` on the host side of a step: which slots a batch computes (the narrowest width
that holds its adapters) and each token's place among them; and the narrow update equals the
update over every slot (docs/lora.md)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jengine.models import ModelConfig
from jengine.models.config import RopeConfig
from jengine.models.lora import add_delta
from jengine.runtime.lora_slots import NO_SLOT, LoraSlots, pick_slots

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=24,
                  num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                  max_position_embeddings=64, rms_norm_eps=1e-5, rope=RopeConfig())


def _adapter(seed: int, slots: LoraSlots, rank: int = 2) -> list[dict]:
    """Random per-layer host weights {target: (a [*in, r], b [r, *out])}, non-zero B."""
    rng = np.random.default_rng(seed)
    return [{t: (rng.standard_normal((*ins, rank)).astype(np.float32),
                 rng.standard_normal((rank, *outs)).astype(np.float32))
             for t, (ins, outs) in slots.shapes.items()} for _ in range(CFG.num_layers)]


@pytest.fixture(scope="module")
def slots():
    s = LoraSlots(CFG, jnp.float32, max_loras=8, max_rank=4)
    s.ensure(set(range(1, 9)), lambda i: _adapter(i, s))
    return s


def test_widths_are_powers_of_two_up_to_max_loras():
    assert LoraSlots(CFG, jnp.float32, max_loras=6, max_rank=2).widths == (1, 2, 4, 6)
    assert LoraSlots(CFG, jnp.float32, max_loras=1, max_rank=2).widths == (1,)


def test_a_batch_computes_the_narrowest_width_holding_its_adapters(slots):
    slot_of = {i: slots.ids.index(i) for i in range(1, 9)}
    q_lens = np.asarray([2, 1, 1, 3])
    tokens, pick = slots.token_slots(np.asarray([5, 0, 5, 5]), q_lens)
    assert pick.tolist() == [slot_of[5]]
    assert tokens.tolist() == [0, 0, NO_SLOT, 0, 0, 0, 0]
    tokens, pick = slots.token_slots(np.asarray([7, 2, 0, 4]), q_lens)
    assert len(pick) == 4 and sorted(pick[:3].tolist()) == sorted(slot_of[i] for i in (7, 2, 4))
    assert [pick[k] for k in tokens if k != NO_SLOT] == \
        [slot_of[7]] * 2 + [slot_of[2]] + [slot_of[4]] * 3
    tokens, pick = slots.token_slots(np.asarray([0, 0]), np.asarray([1, 1]))
    assert pick.tolist() == [0] and tokens.tolist() == [NO_SLOT, NO_SLOT]
    ids = np.asarray([1, 2, 3, 4, 5, 6, 7, 8])  # every slot: computed in place, no gather
    tokens, pick = slots.token_slots(ids, np.ones(8, np.int64))
    assert pick is None and tokens.tolist() == [slot_of[i] for i in ids.tolist()]
    tokens, pick = slots.token_slots(np.asarray([5, 0]), np.asarray([1, 1]), narrow=False)
    assert pick is None and tokens.tolist() == [slot_of[5], NO_SLOT]  # a features step


def test_the_narrow_update_equals_the_update_over_every_slot(slots):
    ids, q_lens = np.asarray([3, 0, 8, 3, 6]), np.asarray([1, 2, 1, 1, 1])
    narrow, pick = slots.token_slots(ids, q_lens)
    wide = np.repeat([slots.ids.index(i) if i else NO_SLOT for i in ids.tolist()], q_lens)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, CFG.hidden_size)), jnp.float32)
    y = jnp.zeros((6, CFG.intermediate_size), jnp.float32)
    layer, picked = slots.tree[1], pick_slots(slots.tree, jnp.asarray(pick))[1]
    full = add_delta(y, x, layer, "w_up", jnp.asarray(wide, jnp.int32))
    assert np.abs(np.asarray(full)[0]).max() > 0.1 and not np.asarray(full)[1:3].any()
    np.testing.assert_allclose(add_delta(y, x, picked, "w_up", jnp.asarray(narrow)), full,
                               rtol=1e-5, atol=1e-5)
