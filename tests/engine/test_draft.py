"""Speculative decoding with a draft model (`jengine.core.draft`): tiny random Llamas of one
vocabulary as target and draft; outputs equal plain decoding's, greedy and seeded."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from verify_all import verifying_everything  # tests/verify_all.py

from jengine import Engine, SamplingParams

ONE_BUCKET = str(Path(__file__).parents[1] / "one_bucket.yaml")


def _tiny_llama(path: Path, seed: int, vocab: int = 96) -> str:
    """A random 2-layer Llama with a word-level tokenizer over its `vocab` tokens."""
    import torch

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("draft")
    return {"target": _tiny_llama(root / "target", 0), "other": _tiny_llama(root / "other", 1),
            "small_vocab": _tiny_llama(root / "small_vocab", 2, vocab=80)}


@pytest.fixture(scope="module")
def plain(models_dir):
    return Engine(models_dir["target"], config=ONE_BUCKET, progress=False)


PROMPTS = [np.random.default_rng(i).integers(3, 96, n).tolist() for i, n in enumerate((5, 12, 30))]


def _tokens(engine, sp):
    return [[c.token_ids for c in o.outputs] for o in engine.generate(PROMPTS, sp)]


def _spec(models_dir, draft: str) -> Engine:
    # A draft as large as its target never pays, so the cost model would rightly stop drafting.
    return verifying_everything(Engine(
        models_dir["target"], config=ONE_BUCKET, speculative="draft", num_speculative_tokens=3,
        draft_model=models_dir[draft], progress=False))


def test_the_target_as_its_own_draft_is_always_accepted(models_dir, plain):
    """Drafting with the target's own weights: every greedy proposal is the target's argmax,
    so each verification keeps all of them, and the tokens equal plain decoding's."""
    spec = _spec(models_dir, "target")
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert _tokens(spec, sp) == _tokens(plain, sp)
    stats = spec.stats()
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens >= 0.95 * stats.spec_num_draft_tokens
    draft = spec.core.scheduler.speculator.proposer.core
    assert not draft.has_unfinished  # every draft request ran to its end


def test_another_draft_leaves_greedy_and_seeded_outputs_unchanged(models_dir, plain):
    """A draft of other weights (its proposals mostly wrong): greedy tokens and seeded samples
    (each row draws with its output index's key) equal plain decoding's."""
    spec = _spec(models_dir, "other")
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert _tokens(spec, greedy) == _tokens(plain, greedy)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, seed=5, n=2, ignore_eos=True)
    assert _tokens(spec, seeded) == _tokens(plain, seeded)
    stats = spec.stats()
    assert 0 <= stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_a_draft_must_share_the_vocabulary(models_dir):
    with pytest.raises(ValueError, match="vocabulary"):
        _spec(models_dir, "small_vocab")
    with pytest.raises(ValueError, match="needs a draft model"):
        Engine(models_dir["target"], config=ONE_BUCKET, speculative="draft", progress=False)


def test_each_data_parallel_replica_drafts_on_its_own_devices(models_dir, plain):
    """dp=2: every replica builds its own draft core on that replica's devices."""
    spec = verifying_everything(Engine(
        models_dir["target"], config=ONE_BUCKET, mesh="dp=2", speculative="draft",
        num_speculative_tokens=2, draft_model=models_dir["other"], progress=False))
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert _tokens(spec, greedy) == _tokens(plain, greedy)
    devices = []
    for replica in spec.core.replicas:
        draft = replica.scheduler.speculator.proposer.core
        devices.append({d for a in jax.tree.leaves(draft.runner.params) for d in a.devices()})
        assert devices[-1] <= {d for a in jax.tree.leaves(replica.runner.params)
                               for d in a.devices()}
    assert devices[0].isdisjoint(devices[1])
