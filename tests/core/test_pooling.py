"""`jengine.core.pooling` on the host: the pooling a model dir's sentence-transformers files ask
for, the flags that override them, and a request's pool folded chunk by chunk."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jengine.cli.main import build_parser
from jengine.core.pooling import PooledState, resolve_pooling
from jengine.engine import build_config
from jengine.engine_flags import engine_kwargs
from jengine.pooling_params import PoolingParams


def _st_dir(path, modes: dict, normalize: bool, config: dict | None = None):
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_the_model_files_set_the_defaults_and_flags_win(tmp_path):
    cls_dir = _st_dir(tmp_path, {"pooling_mode_cls_token": True,
                                 "pooling_mode_mean_tokens": False}, normalize=False,
                      config={"matryoshka_dimensions": [8, 16, 99]})
    found = resolve_pooling("embed", None, None, cls_dir, 32)
    assert (found.method, found.normalize, found.matryoshka) == ("cls", False, (8, 16))
    forced = resolve_pooling("score", "last", True, cls_dir, 32)
    assert (forced.method, forced.normalize) == ("last", True)
    plain = resolve_pooling("embed", None, None, None, 32)  # no files: last token, normalised
    assert (plain.method, plain.normalize, plain.matryoshka) == ("last", True, None)
    assert resolve_pooling("generate", None, None, cls_dir, 32) is None


def test_what_cannot_be_served_is_a_value_error(tmp_path):
    max_dir = _st_dir(tmp_path, {"pooling_mode_max_tokens": True}, normalize=True)
    with pytest.raises(ValueError, match="pass pooling explicitly"):
        resolve_pooling("embed", None, None, max_dir, 32)
    assert resolve_pooling("embed", "mean", None, max_dir, 32).method == "mean"
    for args, message in [(("classify", None, None), "task must be one of"),
                          (("embed", "max", None), "pooling must be one of"),
                          (("generate", "mean", None), "apply to task")]:
        with pytest.raises(ValueError, match=message):
            resolve_pooling(*args, None, 32)
    pooling = resolve_pooling("embed", None, None, None, 32)
    pooling.check(PoolingParams(dimensions=32))  # the full width is always allowed
    with pytest.raises(ValueError, match="matryoshka"):
        pooling.check(PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)


@pytest.mark.parametrize("method", ["mean", "last", "cls"])
def test_chunks_and_a_restart_pool_as_one_pass(method):
    rows = np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32)
    want = {"mean": rows.mean(0), "last": rows[-1], "cls": rows[0]}[method]
    pool = PooledState(method, 10, PoolingParams())
    pool.add(np.arange(0, 6), rows[:6])
    pool.add(np.arange(0, 4), rows[:4])  # preempted: recomputed from position 0
    pool.add(np.arange(4, 8), rows[4:8])
    pool.add(np.arange(8, 10), rows[8:])
    np.testing.assert_allclose(pool.vector(), want, rtol=1e-6)


def test_the_flags_reach_the_config():
    args = build_parser().parse_args(["serve", "--task", "embed", "--pooling", "cls",
                                      "--no-normalize"])
    kwargs = engine_kwargs(args)
    model = build_config(kwargs.pop("model"), kwargs.pop("config"), **kwargs).model
    assert (model.task, model.pooling, model.normalize) == ("embed", "cls", False)
    plain = build_config(None, None).model
    assert (plain.task, plain.pooling, plain.normalize) == ("generate", None, None)
