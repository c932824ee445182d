"""Multi-LoRA serving against HF transformers + PEFT: each adapter's greedy tokens, a batch
mixing the base model and several adapters, slot swaps, the prefix cache keyed by adapter,
tp=2, and bad adapters (docs/lora.md)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from lora_adapters import ATTENTION, base_model, hf_greedy, random_adapter

from jengine import Engine, LoRARequest, SamplingParams

ONE_BUCKET = str(Path(__file__).parents[1] / "one_bucket.yaml")
STEPS = 10
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True)


def _prompts(seed: int = 0, lengths=(5, 21)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 96, n).tolist() for n in lengths]


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
def test_each_adapter_equals_hf_peft(tmp_path, family):
    """Greedy tokens under each adapter (all projections at r=8; attention only at r=4 with
    rsLoRA, zero-padded to the slots' rank 8) are PEFT's, and the base model's stay HF's."""
    base = base_model(tmp_path / "base", family)
    models = {
        "all": random_adapter(tmp_path / "base", tmp_path / "all", family, r=8, alpha=16,
                              seed=1),
        "attn": random_adapter(tmp_path / "base", tmp_path / "attn", family, r=4, alpha=8,
                               targets=ATTENTION, seed=2, rslora=True),
    }
    prompts = _prompts()
    engine = Engine(str(tmp_path / "base"), config=ONE_BUCKET, enable_lora=True, max_loras=2,
                    max_lora_rank=8, progress=False)
    assert _tokens(engine.generate(prompts, GREEDY)) == [hf_greedy(base, p, STEPS)
                                                         for p in prompts]
    for i, (name, model) in enumerate(models.items(), start=1):
        expected = [hf_greedy(model, p, STEPS) for p in prompts]
        assert expected != [hf_greedy(base, p, STEPS) for p in prompts]  # the adapter matters
        request = LoRARequest(name, i, str(tmp_path / name))
        assert _tokens(engine.generate(prompts, GREEDY, lora_request=request)) == expected, name


@pytest.fixture(scope="module")
def four_adapters(tmp_path_factory):
    """A SmolLM2-shaped base, four adapters (ranks 2-8, mixed targets) and their HF oracles'
    greedy tokens for three prompts: {name: (LoRARequest or None, [tokens per prompt])}."""
    root = tmp_path_factory.mktemp("lora4")
    prompts = _prompts(1, (4, 19, 40))
    base = base_model(root / "base", "llama")
    cases = {"base": (None, [hf_greedy(base, p, STEPS) for p in prompts])}
    for i, (r, targets) in enumerate([(8, None), (2, ATTENTION), (4, None),
                                      (8, ["q_proj", "down_proj"])], start=1):
        kw = {"targets": targets} if targets else {}
        model = random_adapter(root / "base", root / f"a{i}", "llama", r=r, alpha=2 * r,
                               seed=10 + i, **kw)
        cases[f"a{i}"] = (LoRARequest(f"a{i}", i, str(root / f"a{i}")),
                          [hf_greedy(model, p, STEPS) for p in prompts])
    return root, prompts, cases


def test_a_batch_mixing_the_base_and_four_adapters_gives_each_its_solo_tokens(four_adapters):
    root, prompts, cases = four_adapters
    engine = Engine(str(root / "base"), config=ONE_BUCKET, enable_lora=True, max_loras=4,
                    max_lora_rank=8, progress=False)
    solo = {name: _tokens(engine.generate(prompts, GREEDY, lora_request=lora))
            for name, (lora, _) in cases.items()}
    assert solo == {name: expected for name, (_, expected) in cases.items()}
    # All fifteen requests in one call: the steps mix the base model and all four adapters.
    mixed = engine.generate([p for _ in cases for p in prompts], GREEDY,
                            lora_request=[lora for lora, _ in cases.values() for _ in prompts])
    got = _tokens(mixed)
    assert {name: got[k * 3:(k + 1) * 3] for k, name in enumerate(cases)} == solo


def test_more_adapters_than_slots_swap_without_a_compile(four_adapters):
    """Two slots, four adapters in one call: requests wait for a slot, adapters are copied in
    between steps (narrow and full-width steps), every request still gets its own tokens, and
    nothing compiles after ready."""
    root, prompts, cases = four_adapters
    engine = Engine(str(root / "base"), config=ONE_BUCKET, enable_lora=True, max_loras=2,
                    max_lora_rank=8, max_cpu_loras=2, warmup=True, progress=False)
    names = [n for n in cases if n != "base"] * 2  # a1..a4, then a1..a4 again
    outs = engine.generate([prompts[2]] * len(names), GREEDY,
                           lora_request=[cases[n][0] for n in names])
    assert _tokens(outs) == [cases[n][1][2] for n in names]
    # Two host copies, but queued requests keep theirs: each adapter read once, no disk reread.
    assert engine.core.loras.reads == 4
    assert engine.core.compiles_since_ready == 0


def test_prefix_cache_keys_pages_by_adapter(four_adapters):
    root, prompts, cases = four_adapters
    engine = Engine(str(root / "base"), config=ONE_BUCKET, enable_lora=True, max_loras=2,
                    max_lora_rank=8, progress=False)
    prompt = prompts[2]  # 40 tokens: two full pages of 16
    a1, a2 = cases["a1"][0], cases["a2"][0]

    def run(lora):
        [out] = engine.generate([prompt], GREEDY, lora_request=lora)
        return out.num_cached_tokens, out.outputs[0].token_ids

    assert run(a1) == (0, cases["a1"][1][2])
    assert run(a2) == (0, cases["a2"][1][2])  # a1's pages hold a1's K/V: not shared
    assert run(None) == (0, cases["base"][1][2])
    assert run(a1) == (32, cases["a1"][1][2])  # its own pages are found again
    assert run(a2)[0] == 32


@pytest.fixture(scope="module")
def one_slot(four_adapters):
    """One slot of rank 4 and one host copy (max_cpu_loras defaults to max_loras)."""
    root = four_adapters[0]
    return Engine(str(root / "base"), config=ONE_BUCKET, enable_lora=True, max_loras=1,
                  max_lora_rank=4, progress=False)


def test_bad_adapters_are_value_errors_and_the_engine_keeps_serving(four_adapters, one_slot,
                                                                    tmp_path):
    root, prompts, cases = four_adapters
    engine = one_slot
    with pytest.raises(ValueError, match="rank 8, over max_lora_rank 4"):
        engine.generate(prompts, GREEDY, lora_request=cases["a1"][0])
    with pytest.raises(ValueError, match="does not exist"):
        engine.generate(prompts, GREEDY, lora_request=LoRARequest("x", 9, str(tmp_path / "no")))
    other = base_model(tmp_path / "other", "qwen3")  # another base: 64 wide, not 72
    del other
    random_adapter(tmp_path / "other", tmp_path / "qwen_lora", "qwen3", r=2, alpha=4)
    with pytest.raises(ValueError, match=r"lora_[AB]\.weight' has shape \[\d+, \d+\]; this "
                       r"model needs"):
        engine.generate(prompts, GREEDY,
                        lora_request=LoRARequest("q", 10, str(tmp_path / "qwen_lora")))
    with pytest.raises(ValueError, match="without enable_lora"):
        Engine(str(root / "base"), config=ONE_BUCKET, progress=False).generate(
            prompts, GREEDY, lora_request=cases["a2"][0])
    # The engine serves on, with the adapter that fits.
    assert _tokens(engine.generate(prompts, GREEDY, lora_request=cases["a3"][0])) == \
        cases["a3"][1]


def test_tensor_parallel_equals_one_device(tmp_path):
    """tp=2: each slot's A splits like its base weight's input, B like its output; tokens
    equal tp=1's and PEFT's."""
    base_model(tmp_path / "base", "llama_16x8")
    model = random_adapter(tmp_path / "base", tmp_path / "a", "llama_16x8", r=4, alpha=8,
                           seed=3)
    prompts = _prompts(2)
    expected = [hf_greedy(model, p, STEPS) for p in prompts]
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    for mesh in ("tp=1", "tp=2"):
        engine = Engine(str(tmp_path / "base"), config=ONE_BUCKET, mesh=mesh, enable_lora=True,
                        max_loras=2, max_lora_rank=4, progress=False)
        assert _tokens(engine.generate(prompts, GREEDY, lora_request=lora)) == expected, mesh
        if mesh == "tp=2":
            slots = engine.core.runner.loras.tree[0]
            assert tuple(slots["wq"]["b"].sharding.spec)[2] == "tp"  # [N, R, H*D]: by heads
            assert tuple(slots["w_down"]["a"].sharding.spec)[0] == "tp"  # [F, N, R]: mlp
        del engine


def test_an_adapter_directory_deleted_after_load_fails_no_step(four_adapters, one_slot,
                                                               tmp_path):
    """One slot and one host copy, two adapters queued, then their directories deleted: the
    host copies of adapters that queued requests use are kept past max_cpu_loras, so the
    second adapter's slot fill needs no disk, and both requests get their solo tokens."""
    import shutil

    root, prompts, cases = four_adapters
    core = one_slot.core
    reads = core.loras.reads
    for name in ("a2", "a3"):  # ranks 2 and 4
        shutil.copytree(root / name, tmp_path / name)
        core.add_request(name, prompts[2], GREEDY, lora_request=LoRARequest(
            name, 100 + cases[name][0].lora_int_id, str(tmp_path / name)))
        shutil.rmtree(tmp_path / name)
    tokens = {"a2": [], "a3": []}
    while core.has_unfinished:
        for out in core.step():  # each output: the step's new tokens
            tokens[out.request_id] += out.outputs[0].token_ids
    assert tokens == {"a2": cases["a2"][1][2], "a3": cases["a3"][1][2]}
    assert core.loras.reads == reads + 2
