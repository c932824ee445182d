"""Speculative decoding with a draft model (`speculative.method: draft`): a smaller model of the
same vocabulary proposes each speculating sequence's next `k` tokens, and the target verifies
them in its ordinary ragged step (`jengine.scheduling.speculative` has the acceptance rule).

The draft runs on an `EngineCore` of its own: its own weights, paged KV cache, scheduler and
buckets, with prefix caching on. Each proposal round submits every speculating sequence's
tokens as a greedy request of `k` tokens and steps the draft core until all of them finish:
the prefix cache finds the pages the sequence's earlier rounds computed, so a round prefills
only the tokens since its last one (and the partial last page), then decodes `k - 1` steps
for the whole batch at once. Greedy drafting puts all the proposer's mass on one token, so the
target's rule for the n-gram proposer (keep row j + 1's draw while row j drew proposal j) is
the exact rejection rule here too: outputs keep the target model's distribution.

A round runs on the host's side of the target step (the target cannot run ahead while a
sequence waits for its proposal), so its seconds show in the host gap the cost model weighs
(`StepCosts.gap`); where drafting does not pay, the cost model stops proposing.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from converters import LoadedModel
from jengine.config import EngineConfig, LoraConfig
from jengine.sampling_params import SamplingParams
from jengine.scheduling.speculative import (
    NgramProposer,
    Proposal,
    check_num_tokens,
    make_proposer,
)


class DraftProposer:
    """Greedy proposals from a draft model on its own engine core."""

    # A round costs steps of a model: the scheduler asks the cost model before drafting
    # (`Speculator._drafting_may_pay`), not only after, when the round is paid for.
    drafts = True

    def __init__(self, core, num_tokens: int):
        check_num_tokens(num_tokens)
        self.core = core  # an EngineCore of the draft model
        self.num_tokens = num_tokens
        self._ids = itertools.count()

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `min(num_tokens, limit)` proposed next tokens of `tokens` ([] for none)."""
        return self.propose_many([(tokens, limit)])[0].tokens

    def propose_many(self, requests: list[tuple[list[int], int]]) -> list[Proposal]:
        """Each (tokens, limit)'s proposal, drafted for all of them in one batch."""
        ids: list[str | None] = []
        for tokens, limit in requests:
            k = min(self.num_tokens, limit)
            if k <= 0 or len(tokens) + k > self.core.max_model_len:
                ids.append(None)
                continue
            request_id = f"draft-{next(self._ids)}"
            self.core.add_request(request_id, list(tokens), SamplingParams(
                max_tokens=k, temperature=0.0, ignore_eos=True))
            ids.append(request_id)
        drafted: dict[str, list[int]] = {i: [] for i in ids if i is not None}
        while self.core.has_unfinished:
            for out in self.core.step():
                drafted[out.request_id] += out.outputs[0].token_ids
        return [Proposal(drafted[i] if i is not None else []) for i in ids]


def _check_vocabulary(target: LoadedModel, draft) -> None:
    """The draft must speak the target's token ids: same vocabulary, same tokens."""
    if draft.model_config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({draft.model_config.vocab_size} ids) "
                         f"differs from the target's ({target.config.vocab_size}); a draft "
                         "model must share the target's tokenizer")
    theirs, ours = draft.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    if theirs != ours:
        raise ValueError("the draft model's tokenizer maps tokens to other ids than the "
                         "target's; a draft model must share the target's tokenizer")


def proposer_for(
    cfg: EngineConfig, target: LoadedModel, build_core: Callable[[EngineConfig], object],
) -> NgramProposer | DraftProposer | None:
    """The proposer `cfg.speculative` asks for (None: speculation off). A draft model's core is
    `build_core(its config)`: the target's settings (context length and KV budget included)
    with the draft's weights and prefix caching on.

    Raises:
      ValueError: an unknown method, `draft` without a `draft_model` or across hosts, or a
        draft model whose vocabulary differs from the target's.
    """
    spec = cfg.speculative
    if spec.method != "draft":
        return make_proposer(spec)
    if not spec.draft_model:
        raise ValueError("speculative 'draft' needs a draft model (--draft-model, "
                         "Engine(draft_model=...), speculative.draft_model)")
    if cfg.parallel.num_processes > 1:
        raise ValueError("speculative 'draft' runs on one host (num_processes 1); "
                         "use 'ngram' across hosts")
    core = build_core(dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, model=spec.draft_model),
        cache=dataclasses.replace(cfg.cache, enable_prefix_caching=True),
        speculative=dataclasses.replace(spec, method=None),
        lora=LoraConfig(),  # the draft proposes without the requests' adapters
    ))
    _check_vocabulary(target, core)
    return DraftProposer(core, spec.proposal_tokens())
