"""LoRA in the host-side step layer: the scheduler keeps the running adapters within
`max_loras` (base-model requests never wait on it), and the prefix cache keys pages by
adapter."""

from __future__ import annotations

from jengine.sampling_params import SamplingParams
from jengine.scheduling.page_allocator import PageAllocator
from jengine.scheduling.prefix_cache import PrefixCache
from jengine.scheduling.scheduler import Scheduler
from jengine.scheduling.sequence import Sequence


def _seq(i: int, lora_id: int) -> Sequence:
    return Sequence(seq_id=i, request_id=f"r{i}", index=0, prompt_ids=[5 + i] * 20,
                    params=SamplingParams(max_tokens=4), seed=0, max_tokens=4, lora_id=lora_id)


def test_a_new_adapter_waits_while_every_slot_is_taken():
    scheduler = Scheduler(PageAllocator(64, 16), max_num_seqs=8, max_num_batched_tokens=256,
                          max_model_len=128, max_loras=2)
    seqs = [_seq(0, 1), _seq(1, 2), _seq(2, 3), _seq(3, 0), _seq(4, 1)]
    for seq in seqs:
        scheduler.add([seq])
    batch = scheduler.schedule()
    assert [s.seq_id for s in batch.seqs] == [0, 1, 3, 4]  # adapter 3 waits; the base does not
    assert batch.lora_ids.tolist() == [1, 2, 0, 1]
    scheduler.finish(seqs[0], "stop")
    scheduler.finish(seqs[4], "stop")  # adapter 1 leaves: 3 may come in
    assert 2 in [s.seq_id for s in scheduler.schedule().seqs]


def test_a_batch_without_adapters_has_no_lora_ids():
    scheduler = Scheduler(PageAllocator(64, 16), max_num_seqs=8, max_num_batched_tokens=256,
                          max_model_len=128, max_loras=2)
    scheduler.add([_seq(0, 0)])
    assert scheduler.schedule().lora_ids is None


def test_the_same_tokens_under_two_adapters_share_no_page():
    alloc = PageAllocator(16, 4)
    cache = PrefixCache(alloc)
    tokens = list(range(10, 18))  # two full pages
    pages = alloc.allocate(2)
    cache.insert(tokens, pages, adapter=1)
    assert cache.match(tokens, adapter=1) == pages
    assert cache.match(tokens, adapter=2) == []
    assert cache.match(tokens) == []
    other = alloc.allocate(2)
    cache.insert(tokens, other)  # the base model's copy hangs apart
    assert cache.match(tokens) == other and cache.match(tokens, adapter=1) == pages
