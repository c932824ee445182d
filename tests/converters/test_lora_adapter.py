"""Reading PEFT LoRA directories (`converters.lora_adapter`): layout and scale against PEFT's
own tensors, and a named ValueError for everything that is not built or does not fit."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from lora_adapters import ATTENTION, base_model, random_adapter

from converters import load_config
from converters.lora_adapter import load_adapter


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_base")
    base_model(root / "base", "llama")
    return root, load_config(str(root / "base"))


def _adapter(root, name, **kw):
    out = root / name
    if not out.exists():
        random_adapter(root / "base", out, "llama", **kw)
    copy = root / f"{name}_edit"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(out, copy)
    return copy


def test_layout_and_scale_follow_peft(base):
    root, cfg = base
    model = random_adapter(root / "base", root / "plain", "llama", r=4, alpha=12, seed=5)
    rs = random_adapter(root / "base", root / "rs", "llama", r=4, alpha=12, seed=5,
                        rslora=True, targets=ATTENTION)
    adapter = load_adapter(root / "plain", cfg, max_rank=8)
    layer = dict(model.named_modules())["base_model.model.model.layers.1.self_attn.q_proj"]
    a_hf = layer.lora_A["default"].weight.detach().numpy()  # [r, E]
    b_hf = layer.lora_B["default"].weight.detach().numpy()  # [H*D, r]
    a, b = adapter.layers[1]["wq"]
    assert a.shape == (72, 4) and b.shape == (4, 9, 8)
    x = np.random.default_rng(0).standard_normal((3, 72)).astype(np.float32)
    want = x @ a_hf.T @ b_hf.T * (12 / 4)  # PEFT: B(A(x)) * alpha / r
    np.testing.assert_allclose(np.einsum("te,er,rhd->thd", x, a, b).reshape(3, -1), want,
                               rtol=1e-5, atol=1e-5)
    assert set(adapter.layers[0]) == {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
    rs_adapter = load_adapter(root / "rs", cfg, max_rank=8)
    assert set(rs_adapter.layers[0]) == {"wq", "wk", "wv", "wo"}
    a_rs = dict(rs.named_modules())["base_model.model.model.layers.1.self_attn.q_proj"]
    assert a_rs.scaling["default"] == pytest.approx(12 / math.sqrt(4))  # rsLoRA: alpha/sqrt(r)


def _edit_config(path, **changes):
    file = path / "adapter_config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))


@pytest.mark.parametrize("changes, message", [
    ({"use_dora": True}, "DoRA adapters"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens adapters are not built"),
    ({"target_modules": ["lm_head"]}, "lm_head adapters are not built"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not built"),
])
def test_features_that_are_not_built_are_named(base, changes, message):
    root, cfg = base
    path = _adapter(root, "a", r=2, alpha=4)
    _edit_config(path, **changes)
    with pytest.raises(ValueError, match=message):
        load_adapter(path, cfg, max_rank=8)


def test_missing_corrupt_and_misfit_files(base):
    root, cfg = base
    path = _adapter(root, "a", r=2, alpha=4)
    with pytest.raises(ValueError, match="rank 2, over max_lora_rank 1"):
        load_adapter(path, cfg, max_rank=1)
    (path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad")
    with pytest.raises(ValueError, match="corrupt or truncated safetensors"):
        load_adapter(path, cfg, max_rank=8)
    (path / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        load_adapter(path, cfg, max_rank=8)
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt adapter_config.json"):
        load_adapter(path, cfg, max_rank=8)
    (path / "adapter_config.json").unlink()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        load_adapter(path, cfg, max_rank=8)
    with pytest.raises(ValueError, match="does not exist"):
        load_adapter(root / "nowhere", cfg, max_rank=8)


def test_a_truncated_tensor_is_corrupt(base):
    root, cfg = base
    path = _adapter(root, "a", r=2, alpha=4)
    file = path / "adapter_model.safetensors"
    file.write_bytes(file.read_bytes()[:-64])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_adapter(path, cfg, max_rank=8)
