"""Where settings come from: a keyword or flag that is given wins over the preset, even when it
equals the default; one not given leaves the preset (or the config dataclass) to decide. No engine
is built here. (The import rules are tests/test_layers.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from jengine.cli.main import build_parser
from jengine.cli.serve import server_config
from jengine.config import ServerConfig
from jengine.engine import build_config
from jengine.engine_flags import engine_kwargs

ROOT = Path(__file__).resolve().parents[2]


def test_a_keyword_equal_to_its_default_still_beats_the_preset():
    # configs/test.yaml sets max_num_seqs 16 and dtype float32; the defaults are 64 and auto.
    assert build_config(None, "test").scheduler.max_num_seqs == 16
    assert build_config(None, "test", max_num_seqs=64).scheduler.max_num_seqs == 64
    assert build_config(None, "test", dtype="auto").model.dtype == "auto"
    assert build_config(None, "test", max_num_seqs=None).scheduler.max_num_seqs == 16
    plain = build_config(None, None)
    assert (plain.scheduler.max_num_seqs, plain.parallel.mesh) == (64, "tp=1")


def _cli_config(argv: list[str]):
    args = build_parser().parse_args(argv)
    kwargs = engine_kwargs(args)
    return args, build_config(kwargs.pop("model"), kwargs.pop("config"), **kwargs)


def test_a_flag_equal_to_its_default_still_beats_the_preset(tmp_path):
    _, cfg = _cli_config(["serve", "--config", "test", "--max-num-seqs", "64"])
    assert cfg.scheduler.max_num_seqs == 64
    _, cfg = _cli_config(["generate", "hi", "--config", "test"])
    assert cfg.scheduler.max_num_seqs == 16

    preset = tmp_path / "p.yaml"
    preset.write_text("server:\n  port: 9000\n  max_queue: 7\n  allowed_origins: [a.example]\n")
    args, cfg = _cli_config(["serve", "--config", str(preset), "--port", "8000"])
    server = server_config(args, cfg.server)
    assert (server.port, server.max_queue, server.allowed_origins) == (8000, 7, ("a.example",))
    args, cfg = _cli_config(["serve", "--config", str(preset)])
    assert server_config(args, cfg.server).port == 9000
    args, cfg = _cli_config(["serve"])
    assert server_config(args, cfg.server) == ServerConfig()


def test_speculative_settings_from_keywords_flags_and_presets(tmp_path):
    from jengine.scheduling.speculative import make_proposer

    cfg = build_config(None, "test", speculative="ngram", num_speculative_tokens=5)
    assert (cfg.speculative.method, cfg.speculative.num_tokens) == ("ngram", 5)
    assert make_proposer(cfg.speculative).num_tokens == 5
    assert make_proposer(build_config(None, "test").speculative) is None  # off by default
    _, cfg = _cli_config(["generate", "hi", "--speculative", "ngram",
                          "--num-speculative-tokens", "2"])
    assert (cfg.speculative.method, cfg.speculative.num_tokens) == ("ngram", 2)
    preset = tmp_path / "s.yaml"
    preset.write_text("speculative:\n  method: ngram\n  ngram_min: 2\n  ngram_max: 3\n")
    proposer = make_proposer(build_config(None, str(preset)).speculative)
    assert (proposer.ngram_min, proposer.ngram_max, proposer.num_tokens) == (2, 3, 15)
    draft = build_config(None, "test", speculative="draft", draft_model="x").speculative
    assert draft.num_tokens is None and draft.proposal_tokens() == 3  # the methods' defaults
    for bad in (dict(speculative="draft", draft_model="x"), dict(speculative="medusa"),
                dict(speculative="ngram", num_speculative_tokens=0)):
        with pytest.raises(ValueError):
            make_proposer(build_config(None, "test", **bad).speculative)


def test_auto_layer_layout_is_per_layer_arrays_except_on_tpu():
    """Measured: per-layer arrays beat the scan over stacked weights on XLA:CPU and on an H200
    (docs/kernels.md); TPU keeps the scan until it is measured."""
    from jengine.models.layers import resolve_layer_layout

    assert [resolve_layer_layout("auto", p) for p in ("cpu", "gpu", "tpu")] == [
        "unstacked", "unstacked", "stacked"]
    assert resolve_layer_layout("stacked", "gpu") == "stacked"
    with pytest.raises(ValueError, match="unknown layer_layout"):
        resolve_layer_layout("interleaved", "cpu")


def test_image_flags_reach_the_engine_and_server_configs(tmp_path):
    args, cfg = _cli_config(["serve", "--limit-mm-per-prompt", "image=2",
                             "--allowed-local-media-path", str(tmp_path),
                             "--allow-remote-media", "--media-fetch-timeout", "3"])
    assert cfg.model.limit_mm_per_prompt == "image=2"
    server = server_config(args, cfg.server)
    assert (server.allowed_local_media_path, server.allow_remote_media,
            server.media_fetch_timeout) == (str(tmp_path), True, 3.0)
    args, cfg = _cli_config(["serve"])
    server = server_config(args, cfg.server)
    assert (cfg.model.limit_mm_per_prompt, server.allow_remote_media,
            server.allowed_local_media_path) == ("image=4", False, None)
