"""The sparse MoE MLP (jengine/models/moe.py) against HF transformers, beyond logits parity
(tests/models/test_models_parity.py): the same experts chosen for every token, exact ties, the two
compute strategies, and tensor parallelism.

- Routing: hooks on every HF router record its input and chosen experts; `moe.route` on the
  same input must choose the same set of experts with the same weights, token for token.
- Ties: a Mixtral whose expert 5 duplicates expert 2 (router row and weights) ties the two
  exactly on every token. Where the tie falls on the top-k boundary, HF keeps one of them
  (which one `torch.topk` keeps follows no index rule on CPU); jengine must also keep exactly
  k experts, so the logits still match. Choosing both tied experts would not.
- Strategies: the `gather` (decode-sized) and `dense` paths agree, with experts that receive no
  token.
- tp: greedy tokens of a mixed batch through the engine at tp=2 (expert columns split over two
  devices) equal tp=1 and HF's own greedy loop.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import torch
import transformers
from test_models_parity import TOL, VOCAB, _build, _llama_kwargs, _max_diff

from jengine import Engine, SamplingParams
from jengine.models import moe

ONE_BUCKET = str(Path(__file__).parents[1] / "one_bucket.yaml")


def _qwen3_moe_config(**kw):
    return transformers.Qwen3MoeConfig(**_llama_kwargs(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, rope_theta=1e4,
        norm_topk_prob=True, **kw,
    ))


def _record_routing(model) -> list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Per layer, the (input [T, E], probabilities [T, X], chosen experts [T, k]) of every
    router call."""
    calls: list[list] = [[] for _ in model.model.layers]
    for i, layer in enumerate(model.model.layers):
        def hook(module, args, out, i=i):
            logits, _, experts = out
            calls[i].append((args[0].reshape(-1, args[0].shape[-1]),
                             torch.softmax(logits.float(), dim=-1), experts))
        layer.mlp.gate.register_forward_hook(hook)
    return calls


def test_routing_chooses_hfs_experts_token_for_token(tmp_path):
    models: list = []
    loaded, ids, _ = _build(tmp_path, _qwen3_moe_config(), transformers.Qwen3MoeForCausalLM,
                            edit=models.append, greedy=False)
    calls = _record_routing(models[0])
    with torch.no_grad():
        models[0](torch.tensor([ids]))
    cfg = loaded.config
    for layer, [(h, probs, hf_experts)] in enumerate(calls):
        experts, weights = moe.route(jnp.asarray(h.numpy()), loaded.params["router"][layer], cfg)
        experts, weights = np.asarray(experts), np.asarray(weights)
        hf = hf_experts.numpy()
        np.testing.assert_array_equal(np.sort(experts, -1), np.sort(hf, -1), err_msg=str(layer))
        hf_weights = np.take_along_axis(probs.numpy(), hf, -1)
        hf_weights /= hf_weights.sum(-1, keepdims=True)
        order = np.argsort(experts, -1), np.argsort(hf, -1)
        np.testing.assert_allclose(np.take_along_axis(weights, order[0], -1),
                                   np.take_along_axis(hf_weights, order[1], -1), atol=1e-6)


def _duplicate_expert(model, src: int, dst: int) -> None:
    for layer in model.model.layers:
        mlp = layer.mlp
        mlp.gate.weight[dst] = mlp.gate.weight[src]
        mlp.experts.gate_up_proj[dst] = mlp.experts.gate_up_proj[src]
        mlp.experts.down_proj[dst] = mlp.experts.down_proj[src]


def test_exact_ties_keep_k_experts(tmp_path):
    config = transformers.MixtralConfig(**_llama_kwargs(
        num_local_experts=8, num_experts_per_tok=2, rope_theta=1e4,
    ))
    models: list = []

    def edit(model):
        _duplicate_expert(model, 2, 5)
        models.append(model)

    loaded, ids, expected = _build(tmp_path, config, transformers.MixtralForCausalLM, edit=edit,
                                   greedy=False)
    calls = _record_routing(models[0])
    with torch.no_grad():
        models[0](torch.tensor([ids]))
    boundary_ties = 0
    for [(_, probs, hf_experts)] in calls:
        probs = probs.numpy()
        assert np.array_equal(probs[:, 2], probs[:, 5])  # tied on every token
        above = (np.delete(probs, [2, 5], axis=1) > probs[:, 2:3]).sum(1)
        boundary = above == 1  # one of the pair makes the top 2, not both
        kept = np.isin(hf_experts.numpy(), [2, 5]).sum(1)
        assert (kept[boundary] == 1).all()  # HF keeps one of them there
        boundary_ties += int(boundary.sum())
    assert boundary_ties > 0
    assert _max_diff(loaded, ids, expected) < TOL


def test_gather_and_dense_strategies_agree():
    rng = np.random.default_rng(0)
    x, e, f, k = 8, 16, 12, 2
    p = {name: jnp.asarray(rng.standard_normal(shape), jnp.float32) for name, shape in
         (("we_gate", (x, e, f)), ("we_up", (x, e, f)), ("we_down", (x, f, e)))}
    h = jnp.asarray(rng.standard_normal((3, e)), jnp.float32)
    experts = jnp.asarray([[0, 3], [3, 1], [1, 0]], jnp.int32)  # experts 2 and 4-7 get nothing
    weights = jnp.asarray(rng.uniform(size=(3, k)), jnp.float32)
    gathered = moe._gather_experts(h, p, experts, weights)
    dense = moe._dense_experts(h, p, experts, weights, x)
    np.testing.assert_allclose(np.asarray(gathered), np.asarray(dense), rtol=1e-5, atol=1e-5)
    hn = np.asarray(h)
    want = np.zeros_like(hn)
    for t in range(3):
        for j in range(k):
            w = {n: np.asarray(a[int(experts[t, j])]) for n, a in p.items()}
            g = hn[t] @ w["we_gate"]
            want[t] += float(weights[t, j]) * ((g / (1 + np.exp(-g))) * (hn[t] @ w["we_up"])
                                               @ w["we_down"])
    np.testing.assert_allclose(np.asarray(dense), want, rtol=1e-4, atol=1e-4)


def test_info_reports_the_experts(tmp_path, capsys):
    from jengine.cli.main import main

    _build(tmp_path, _qwen3_moe_config(), transformers.Qwen3MoeForCausalLM, greedy=False)
    assert main(["info", str(tmp_path)]) == 0
    fields = dict(line.split(None, 1) for line in capsys.readouterr().out.strip().splitlines())
    assert fields["architecture"] == "qwen3_moe"
    assert fields["experts"] == "8 (2 per token), width 32"


def _hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_tensor_parallel_equals_one_device_and_hf(tmp_path):
    models: list = []
    _build(tmp_path, _qwen3_moe_config(max_position_embeddings=512),
           transformers.Qwen3MoeForCausalLM, edit=models.append, greedy=False)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (5, 17, 40)]
    expected = [_hf_greedy(models[0], p, 16) for p in prompts]
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for mesh in ("tp=1", "tp=2"):
        engine = Engine(str(tmp_path), config=ONE_BUCKET, mesh=mesh)
        outs = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy)]
        assert outs == expected, mesh
        if mesh == "tp=2":
            w = engine.core.runner.params
            w = w["layers"][0]["we_gate"] if "layers" in w else w["we_gate"]
            assert tuple(w.sharding.spec)[-1] == "tp"  # each device: half of every expert
            assert {s.data.shape[-1] for s in w.addressable_shards} == {16}
        del engine
