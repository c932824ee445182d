"""The `jengine` command line: generate without torch (vs HF transformers), info, convert, and
one-line errors with a non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hf_gguf import load_hf_gguf, one_torch_thread  # tests/hf_gguf.py

REPO = Path(__file__).resolve().parents[2]
PROMPT = "The three primary colors are"

# `jengine` with torch made unimportable (a fresh process; argv follows).
NO_TORCH = (
    "import sys; sys.modules['torch'] = None; "
    "from jengine.cli.main import main; rc = main(sys.argv[1:]); "
    "assert sys.modules['torch'] is None; sys.exit(rc)"
)


def _command(*args: str, no_torch: bool) -> tuple[list[str], dict[str, str]]:
    cmd = [sys.executable, "-c", NO_TORCH, *args] if no_torch else [
        sys.executable, "-m", "jengine.cli", *args]
    return cmd, {**os.environ, "PYTHONPATH": str(REPO)}


def jengine(*args: str, no_torch: bool = False, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd, env = _command(*args, no_torch=no_torch)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def _hf_greedy_text(prompt: str, max_new_tokens: int) -> str:
    import torch

    from converters.source import default_model_path

    tok, model = load_hf_gguf(default_model_path())
    ids = tok(prompt, return_tensors="pt").input_ids
    with one_torch_thread(), torch.no_grad():  # jengine's subprocess runs alongside
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_generate_without_torch_matches_hf(tmp_path):
    """`jengine generate` as users run it, with torch unimportable, prints HF's greedy text: the
    CLI, the no-torch install and the default model in one process (the HF side runs meanwhile)."""
    cmd, env = _command("generate", PROMPT, "--max-tokens", "24", "--config", "test",
                        no_torch=True)
    log = tmp_path / "stderr.log"
    with open(log, "w") as err:  # a file: a full stderr pipe would stall the process
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO,
                                env=env)
    try:  # jengine runs while transformers works in this process
        expected = _hf_greedy_text(PROMPT, 24)
        stdout, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log.read_text()[-2000:]
    assert stdout == expected + "\n"
    assert expected.strip()  # a real continuation, not an empty string


BAD_INPUT = [
    (["generate", "hi", "--model", "/no/such/model"], "model path not found"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["info", "/no/such/file.gguf"], "not found"),
    (["generate", "hi", "--config", "no-such-preset"], "config"),
    (["serve", "--kv-cache-memory", "1TiB"], "does not fit in this host's available memory"),
    (["serve", "--mesh", "tp=8", "--cpu-devices", "8", "--kv-cache-memory", "900GiB"],
     "does not fit"),
    (["serve", "--ssl-keyfile", "/no/key.pem"], "--ssl-keyfile and --ssl-certfile"),
    (["serve", "--max-n", "0"], "--max-n must be positive"),
    (["serve", "a.gguf", "--model", "b.gguf"], "the model is given twice"),
    (["serve", "-tp", "2", "--mesh", "tp=2"], "not both"),
]


@pytest.fixture(scope="module")
def cli_runs() -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """The runs of `jengine info` and of every BAD_INPUT command, two at a time: the tests only
    read their results, and each is mostly an interpreter start and the CLI's imports (3-4 s of
    one core; `info` also reads the model) before it answers, so a second core halves the wait.
    `info` is the longest, so it starts first."""
    commands = [("info",)] + [tuple(args) for args, _ in BAD_INPUT]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(commands, pool.map(lambda args: jengine(*args), commands)))


def test_the_generate_path_imports_no_server_and_no_pallas():
    """What `jengine generate` imports before it opens a model (its command module and the
    engine) leaves out the HTTP and gRPC server, Pallas (with its Mosaic and Triton kernels)
    and transformers: start-up time that a CPU generate has no use for."""
    unwanted = ("jengine.server", "jax._src.pallas", "jax.experimental.pallas", "transformers",
                "grpc", "fastapi", "llguidance")
    code = ("import sys, jengine.cli.main, jengine.engine; "
            f"print(' '.join(m for m in sys.modules if m.startswith({unwanted!r})))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == []


def test_info_describes_the_default_model(cli_runs):
    run = cli_runs[("info",)]
    assert run.returncode == 0, run.stderr[-2000:]
    fields = dict(line.split(None, 1) for line in run.stdout.strip().splitlines())
    assert fields["architecture"] == "llama"
    assert fields["parameters"] == "134515008"
    assert fields["context_length"] == "8192"
    assert fields["chat_template"] == "True"
    # Q4_1 read as 4-bit groups with w4a16 (else dequantized), F32 dequantize; its one Q8_0
    # tensor is the (tied) embedding, kept in float (int8 under w4a16).
    assert fields["weights"] == ("read as int8 with --quantization int8|w8a16: none; "
                                 "as 4-bit groups with w4a16: 210 x Q4_1; "
                                 "dequantized to float: 61 x F32, 1 x Q8_0")


def test_info_shows_what_auto_dtype_chose_here(tmp_path):
    """`auto_dtype` in `jengine info` is the decision a start stored beside the step programs
    (planted here, with timings no real run gives) for this model and CPU."""
    import dataclasses

    import jax

    from converters.source import load_config
    from jengine.core import auto_dtype
    from jengine.models.matmul import resolve_matmul_backend
    from jengine.runtime.dtype_probe import Timings

    store = tmp_path / "jengine" / "executables"  # default_store_dir() under XDG_CACHE_HOME
    backend = resolve_matmul_backend("auto", jax.default_backend(), 1)
    planted = {"float32": 1.2345, "bfloat16": 6.789}  # ms: float32 faster
    choice = auto_dtype.choose(load_config(None), backend, store,
                               timer=lambda cfg, dt, be: Timings({1: planted[dt] / 1e3}, 0.0))
    cmd, env = _command("info", no_torch=False)
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO,
                         env={**env, "XDG_CACHE_HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-2000:]
    fields = dict(line.split(None, 1) for line in run.stdout.strip().splitlines())
    assert fields["auto_dtype"] == dataclasses.replace(choice, stored=True).summary()
    if auto_dtype.bf16_feature() is not None:
        assert fields["auto_dtype"].startswith("float32: bf16 projections took 5.50x")
        assert "float32 1.23 ms, bfloat16 6.79 ms" in fields["auto_dtype"]


@pytest.mark.parametrize(("args", "message"), BAD_INPUT)
def test_bad_input_is_one_line_error(cli_runs, args, message):
    run = cli_runs[tuple(args)]
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert lines[-1].startswith("jengine: error:") and message in lines[-1]
    assert "Traceback" not in run.stderr


def test_unknown_architecture_dir(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt_bigcode", "architectures": ["X"]}')
    run = jengine("info", str(tmp_path))
    assert run.returncode == 2 and "unsupported architecture 'gpt_bigcode'" in run.stderr


def test_convert_round_trip(tmp_path):
    from converters import load_source

    source = str(load_source.__globals__["default_model_path"]())
    out = tmp_path / "converted"
    run = jengine("convert", source, str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    # Converting onto the existing output must be refused. That run loads the model before it
    # looks at the output, so it goes on while this process checks the first run's checkpoint.
    cmd, env = _command("convert", source, str(out), no_torch=False)
    log = tmp_path / "again.log"
    with open(log, "w") as err:  # a file: a full stderr pipe would stall the process
        again = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO, env=env)
    try:
        original = load_source(None, progress=False)
        converted = load_source(str(out), progress=False)
        assert converted.kind == "checkpoint" and converted.config == original.config
        for name, value in original.params.items():
            np.testing.assert_array_equal(np.asarray(converted.params[name]), value,
                                          err_msg=name)
        for text in ["Hello, world!", "naïve café — 東京 🙂"]:
            assert converted.tokenizer(text).input_ids == original.tokenizer(text).input_ids
        chat = [{"role": "user", "content": "hi"}]
        assert converted.tokenizer.apply_chat_template(chat, tokenize=False) == (
            original.tokenizer.apply_chat_template(chat, tokenize=False))
        assert again.wait(timeout=900) == 2, log.read_text()[-2000:]
    finally:
        if again.poll() is None:
            again.kill()
    assert "already exists" in log.read_text()


def test_serve_on_a_busy_port_is_a_one_line_error():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        run = jengine("serve", "--config", "test", "--port", str(port), timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("jengine: error: cannot listen on 127.0.0.1:") and "Traceback" not in (
        run.stderr)
    assert "listening" not in run.stderr  # it never claimed to listen


def test_serve_flags_reach_the_server_config():
    from jengine.cli.main import _serve_aliases, build_parser
    from jengine.cli.serve import server_config
    from jengine.config import ServerConfig

    args = build_parser().parse_args([
        "serve", "some/model", "-tp", "2", "--served-model-name", "a", "b",
        "--allowed-origins", '["http://x", "http://y"]', "--allowed-methods", "GET,POST",
        "--disable-log-requests", "--max-n", "4", "--default-max-tokens", "32",
        "--request-timeout", "0", "--tool-call-parser", "hermes", "--seed", "7",
        "--root-path", "/api", "--uvicorn-log-level", "warning", "--max-body-bytes", "1000",
        "--limit-concurrency", "0", "--timeout-keep-alive", "2.5", "--reasoning-parser", "auto",
    ])
    _serve_aliases(args)
    assert args.model == "some/model" and args.mesh == "tp=2" and args.seed == 7
    cfg = server_config(args, ServerConfig())
    assert cfg.served_model_name == ("a", "b")
    assert cfg.allowed_origins == ("http://x", "http://y")
    assert cfg.allowed_methods == ("GET", "POST")
    assert not cfg.log_requests and cfg.max_n == 4 and cfg.default_max_tokens == 32
    assert cfg.request_timeout is None and cfg.tool_call_parser == "hermes"
    assert cfg.root_path == "/api" and cfg.uvicorn_log_level == "warning"
    assert cfg.max_body_bytes == 1000 and cfg.reasoning_parser == "auto"
    with pytest.raises(ValueError, match="--reasoning-parser must be one of"):  # a preset's
        server_config(build_parser().parse_args(["serve"]), ServerConfig(reasoning_parser="r1"))
    with pytest.raises(ValueError, match="--tool-call-parser must be one of hermes, llama3_json"):
        server_config(build_parser().parse_args(["serve", "--tool-call-parser", "x"]),
                      ServerConfig())
    for name in ("mistral", "pythonic", "qwen3_coder", "deepseek_v3", "auto"):
        args = build_parser().parse_args(["serve", "--tool-call-parser", name])
        assert server_config(args, ServerConfig()).tool_call_parser == name
    assert cfg.limit_concurrency is None and cfg.timeout_keep_alive == 2.5  # 0: no bound
    for flag, value in (("--limit-concurrency", "-1"), ("--timeout-keep-alive", "0")):
        with pytest.raises(ValueError, match=flag):
            server_config(build_parser().parse_args(["serve", flag, value]), ServerConfig())
    # left at their defaults, the preset decides
    preset = ServerConfig(max_n=9, request_timeout=5.0)
    plain = server_config(build_parser().parse_args(["serve"]), preset)
    assert plain.max_n == 9 and plain.request_timeout == 5.0


def test_batch_dir_flag(tmp_path):
    from jengine.cli.main import build_parser
    from jengine.cli.serve import server_config
    from jengine.config import ServerConfig

    args = build_parser().parse_args(["serve", "--batch-dir", str(tmp_path / "b")])
    assert server_config(args, ServerConfig()).batch_dir == str(tmp_path / "b")
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="--batch-dir .* is not a directory"):
        server_config(build_parser().parse_args(["serve", "--batch-dir", str(tmp_path / "f")]),
                      ServerConfig())


def test_no_web_ui_turns_the_page_off_and_a_preset_can_too():
    from jengine.cli.main import build_parser
    from jengine.cli.serve import server_config
    from jengine.config import ServerConfig

    parse = build_parser().parse_args
    assert server_config(parse(["serve"]), ServerConfig()).web_ui  # on by default
    assert not server_config(parse(["serve", "--no-web-ui"]), ServerConfig()).web_ui
    assert not server_config(parse(["serve"]), ServerConfig(web_ui=False)).web_ui  # the preset's
    assert server_config(parse(["serve", "--web-ui"]), ServerConfig(web_ui=False)).web_ui
