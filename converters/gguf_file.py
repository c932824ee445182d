"""GGUF files: header -> HF-style config, tensors -> dequantized HF-named arrays, tokenizer.

`converters.gguf_reader` parses the file and dequantizes it (with the `gguf` package, llama.cpp's
own, for the block formats it does not vectorise itself: Q5_0, Q4_K, Q5_K, Q6_K, ...), several
tensors at a time in threads (NumPy releases the GIL). What llama.cpp's converter
(`convert_hf_to_gguf.py`) changes on the way in is undone here, so that the model sees HF's
layout: the q/k rows its `LlamaModel` subclasses (llama, Mixtral, Granite, SmolLM3) permute for
their interleaved rope, Gemma's norm weights stored as (1 + w), and the per-expert tensors it
stacks (read as llama.cpp's `[X, out, in]` stacks), and the per-head halves newer converters
split DeepSeek-V2's kv_b_proj into (`attn_k_b`, transposed, and `attn_v_b`; joined back). What
differs per architecture comes from the family's record (`jengine.models.registry`): the
model_type its files read as, the HF config fields its own metadata keys give
(`Family.gguf_config`), its own tensor names, the q/k permutation and the norm offset.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from converters import prequant, tables
from converters.errors import ModelLoadError
from converters.gguf_layouts import join_kv_b, unpermute_rope
from converters.gguf_reader import (
    FOUR_BIT,
    GGUFFormatError,
    GGUFReader,
    TensorInfo,
    dequantize,
    four_bit_groups,
)
from converters.quiet_transformers import import_transformers
from converters.tokenizer_cache import cached_tokenizer
from jengine.models import ModelConfig, family_module
from jengine.models.quant import W4_PROJECTIONS, quantized_names
from jengine.models.registry import BY_GGUF_ARCH, gguf_family

_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's fused projection, as HF's
    # MoE: the router, and each weight of all experts stacked in one tensor [X, out, in].
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    # Qwen2-MoE's shared expert and its gate vector.
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_norm": "post_attention_layernorm",  # Gemma's: its pre_feedforward_layernorm
    "post_attention_norm": "post_attention_layernorm",
}
class GGUFModel:
    """An opened GGUF file. Raises `ModelLoadError` if it is missing, truncated or corrupt."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"model file not found: {self.path}")
        try:
            self.reader = GGUFReader(self.path)
        except (GGUFFormatError, OSError) as e:
            raise ModelLoadError(f"corrupt or truncated GGUF file {self.path}: {e}") from e
        self.meta = self.reader.metadata
        self._by_name = {t.name: t for t in self.reader.tensors}
        self.arch = self.meta.get("general.architecture")
        if self.arch not in BY_GGUF_ARCH:
            raise ModelLoadError(
                f"unsupported architecture {self.arch!r} in {self.path.name}; jengine supports "
                f"{sorted(BY_GGUF_ARCH)}"
            )
        self.family, self._model_type = gguf_family(self.arch)
        self._blocks = _BLOCK_NAMES | dict(self.family.gguf_tensor_names)
        self._blocks |= {base: hf for base, (_, hf) in self.family.gguf_interleaved.items()}
        self._second = {second: base for base, (second, _) in self.family.gguf_interleaved.items()}

    def get(self, key: str, default: Any = None) -> Any:
        """The metadata value `{arch}.{key}`."""
        return self.meta.get(f"{self.arch}.{key}", default)

    def has_tensor(self, name: str) -> bool:
        return name in self._by_name

    def tensor_values(self, name: str) -> np.ndarray | None:
        """The tensor dequantized to float32 (None where the file has none of that name)."""
        t = self._tensor(name)
        return None if t is None else self._dequantize(t)

    def hf_config(self) -> dict[str, Any]:
        """The header as an HF `config.json` dict."""
        names = {t.name for t in self.reader.tensors}
        heads = int(self.get("attention.head_count"))
        hidden = int(self.get("embedding_length"))
        vocab = self.get("vocab_size") or len(self.meta.get("tokenizer.ggml.tokens", []))
        cfg: dict[str, Any] = {
            "model_type": self._model_type,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            **({"intermediate_size": int(self.get("feed_forward_length"))}
               if self.get("feed_forward_length") is not None else {}),
            "num_hidden_layers": int(self.get("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.get("attention.head_count_kv", heads)),
            "head_dim": int(self.get("attention.key_length", hidden // heads)),
            "max_position_embeddings": int(self.get("context_length", 2048)),
            "rms_norm_eps": float(self.get("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.get("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": self.meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.meta.get("tokenizer.ggml.eos_token_id"),
        }
        scaling = self.get("rope.scaling.type")
        freqs = self._tensor("rope_freqs.weight")
        if freqs is not None:  # llama3 scaling, stored by llama.cpp as inv_freq divisors
            cfg["rope_scaling"] = {
                "rope_type": "freq_factors",
                "freq_factors": self._dequantize(freqs).reshape(-1).tolist(),
            }
        elif scaling and scaling not in ("none", "longrope"):
            cfg["rope_scaling"] = {
                "rope_type": scaling,
                "factor": float(self.get("rope.scaling.factor", 1.0)),
                "original_max_position_embeddings": int(
                    self.get("rope.scaling.original_context_length", 8192)
                ),
                **self._yarn_keys(),
            }
        if self.family.gguf_config:  # the architecture's own keys
            try:
                self.family.gguf_config(self, cfg)
            except ValueError as e:
                raise ModelLoadError(str(e)) from e
        return cfg

    def _yarn_keys(self) -> dict[str, float]:
        """The yarn settings llama.cpp's converter writes when the HF config sets them (its
        OLMo 2 class writes the attention factor as `rope.scaling.attn_factor`)."""
        keys = {"attention_factor": ("rope.scaling.yarn_attn_factor", "rope.scaling.attn_factor"),
                "beta_fast": ("rope.scaling.yarn_beta_fast",),
                "beta_slow": ("rope.scaling.yarn_beta_slow",)}
        out = {}
        for hf, names in keys.items():
            value = next((self.get(n) for n in names if self.get(n) is not None), None)
            if value is not None:
                out[hf] = float(value)
        return out

    def _tensor(self, name: str) -> TensorInfo | None:
        return self._by_name.get(name)

    def tensors(self, threads: int | None = None, int8: set[str] = frozenset(),
                w4: set[str] = frozenset()
                ) -> Iterator[tuple[str, np.ndarray | prequant.Int8Tensor | prequant.W4Tensor]]:
        """Yields (HF key, float32 array in HF's [out, in] layout) in file order, dequantized
        `threads` tensors at a time (one per core by default); the Q8_0 tensors named in `int8`
        come as `Int8Tensor`s instead (`int8_tensors`), the 4-bit ones named in `w4` as
        `W4Tensor`s (`w4_tensors`), never dequantized."""
        cfg = self.hf_config()
        infos = self._weight_tensors()
        for t in infos:
            self._hf_name(t.name)  # an unknown tensor fails before any work
        threads = threads or os.cpu_count() or 1
        window = 2 * threads  # tensors dequantized ahead of the consumer, at most
        with ThreadPoolExecutor(threads, thread_name_prefix="jengine-gguf") as pool:
            def submit(t: TensorInfo):
                return pool.submit(self._hf_tensor, t, cfg, t.name in int8, t.name in w4)

            pending = [submit(t) for t in infos[:window]]
            for i in range(len(infos)):
                if i + window < len(infos):
                    pending.append(submit(infos[i + window]))
                yield pending[i].result()
                pending[i] = None  # the consumer owns the array now

    def _weight_tensors(self) -> list[TensorInfo]:
        return [t for t in self.reader.tensors
                if t.name not in _CONFIG_TENSORS and not self._read_with_another(t.name)]

    def int8_tensors(self, cfg: ModelConfig, lm_head: bool) -> tuple[set[str], set[str]]:
        """(names of the Q8_0 tensors to read as int8, the params they fill): the projections
        (and the head, with `lm_head`) every tensor of which is Q8_0 with its blocks along the
        input axis (not DeepSeek's split `attn_k_b`, whose blocks run along output channels)."""
        specs = family_module(cfg).param_specs(cfg)
        eligible = set(quantized_names(specs, cfg.tie_word_embeddings, lm_head))
        placed = {}
        for t in self._weight_tensors():
            if not (t.name.endswith(".attn_k_b.weight") or self._joins(t.name)):
                foldable = t.tensor_type.name == "Q8_0" and len(t.shape) >= 2
                placed[t.name] = (tables.place(cfg, specs, self._hf_name(t.name), t.shape),
                                  foldable)
        params, _ = prequant.int8_params(list(placed.values()), specs, eligible)
        names = {name for name, (targets, foldable) in placed.items()
                 if foldable and any(target.name in params for target in targets)}
        return names, params

    def w4_tensors(self, cfg: ModelConfig) -> tuple[set[str], set[str]]:
        """(names of the 4-bit tensors to read as groups, the params they fill): the layer
        projections `w4a16` stores 4-bit (`quant.W4_PROJECTIONS`) every tensor of which is
        Q4_0 / Q4_1 / Q4_K; a param mixing formats (a Q4_K_M file's Q6_K layers) is read as
        float and quantized at load."""
        specs = family_module(cfg).param_specs(cfg)
        placed = []
        for t in self._weight_tensors():
            if t.name.endswith(".attn_k_b.weight") or self._joins(t.name):  # read as float
                continue
            targets = tables.place(cfg, specs, self._hf_name(t.name), t.shape)
            placed.append((t.name, targets, t.tensor_type.name in FOUR_BIT and len(t.shape) == 2))
        kinds: dict[str, set[bool]] = {}
        for _, targets, four in placed:
            for target in targets:
                kinds.setdefault(target.name, set()).add(four)
        params = {name for name, k in kinds.items() if k == {True} and name in W4_PROJECTIONS
                  and specs[name].contract == tuple(range(1, 1 + len(specs[name].contract)))}
        names = {name for name, targets, four in placed
                 if four and any(target.name in params for target in targets)}
        return names, params

    def formats_note(self, cfg: ModelConfig) -> str:
        """One line: the tensor formats an int8 / w8a16 engine reads as int8, those a w4a16 one
        reads as 4-bit groups, and the rest."""
        folds, _ = self.int8_tensors(cfg, lm_head=False)
        fours, _ = self.w4_tensors(cfg)
        int8, four, floats = Counter(), Counter(), Counter()
        for t in self._weight_tensors():
            kind = t.tensor_type.name
            (int8 if t.name in folds else four if t.name in fours else floats)[kind] += 1

        def counts(c: Counter) -> str:
            return ", ".join(f"{n} x {kind}" for kind, n in c.most_common()) or "none"

        return (f"read as int8 with --quantization int8|w8a16: {counts(int8)}; as 4-bit groups "
                f"with w4a16: {counts(four)}; dequantized to float: {counts(floats)}")

    def _dequantize(self, t: TensorInfo) -> np.ndarray:
        try:
            return dequantize(t, self.reader.data(t))
        except NotImplementedError as e:
            raise ModelLoadError(
                f"unsupported quantization type {t.tensor_type.name} for tensor {t.name} "
                f"in {self.path.name}"
            ) from e

    def _read_with_another(self, name: str) -> bool:
        """DeepSeek-V2's kv_b_proj halves: `attn_v_b` is read with `attn_k_b`, and neither
        where the file also keeps the whole `attn_kv_b` (some converters wrote all three); the
        second of an interleaved pair (`Family.gguf_interleaved`) with the first."""
        if name.endswith(".attn_v_b.weight") or self._base(name) in self._second:
            return True
        return (name.endswith(".attn_k_b.weight")
                and name.replace("attn_k_b", "attn_kv_b") in self._by_name)

    def _hf_tensor(self, t: TensorInfo, cfg: dict[str, Any], int8: bool = False,
                   w4: bool = False
                   ) -> tuple[str, np.ndarray | prequant.Int8Tensor | prequant.W4Tensor]:
        if w4:  # the 4-bit groups, in the rows' HF order
            q, s, m = four_bit_groups(t, self.reader.data(t))
            return self._hf_name(t.name), prequant.W4Tensor(
                *(self._hf_rows(t.name, a, cfg) for a in (q, s, m)))
        if int8:  # the int8 rows with their scales, in the rows' HF order
            w = prequant.fold_q8_0(np.asarray(self.reader.data(t)).reshape(-1, 34), t.shape)
            return self._hf_name(t.name), prequant.Int8Tensor(self._hf_rows(t.name, w.q, cfg),
                                                              self._hf_rows(t.name, w.scale, cfg))
        w = self._dequantize(t)
        if self._joins(t.name):
            w = self._interleaved(t, w)
        if t.name.endswith(".attn_k_b.weight"):
            v_b = self._tensor(t.name.replace("attn_k_b", "attn_v_b"))
            if v_b is None:
                raise ModelLoadError(f"{self.path.name} has {t.name} without its attn_v_b")
            w = join_kv_b(w, self._dequantize(v_b))
        w = self._hf_rows(t.name, w, cfg)
        if self.family.gguf_norm_offset and t.name.endswith("norm.weight"):
            w = w - self.family.gguf_norm_offset
        return self._hf_name(t.name), w

    def _joins(self, name: str) -> bool:
        """Whether the tensor is the first of an interleaved pair (read as float, joined)."""
        return self._base(name) in self.family.gguf_interleaved

    @staticmethod
    def _base(name: str) -> str | None:
        """`attn_q` of `blk.3.attn_q.weight`; None for a tensor outside the blocks."""
        parts = name.split(".")
        return parts[2] if parts[0] == "blk" and len(parts) == 4 else None

    def _interleaved(self, t: TensorInfo, first: np.ndarray) -> np.ndarray:
        """The first of an interleaved pair joined with its second: their rows alternate
        along the output axis ([..., F, in] x 2 -> [..., 2F, in]; biases [..., F] -> [..., 2F])."""
        second_base = self.family.gguf_interleaved[self._base(t.name)][0]
        name = t.name.replace(f".{self._base(t.name)}.", f".{second_base}.")
        second = self._tensor(name)
        if second is None:
            raise ModelLoadError(f"{self.path.name} has {t.name} without its {second_base}")
        axis = -1 if t.name.endswith(".bias") else -2
        pair = np.stack([first, self._dequantize(second)], axis=axis)  # [..., F, 2(, in)]
        shape = list(first.shape)
        shape[axis] *= 2
        return pair.reshape(shape)

    def _hf_rows(self, name: str, w: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
        """`w` (or its per-row scales) with the q/k rows llama.cpp permuted back in HF's order."""
        if self.family.gguf_permuted_qk and name.endswith(("attn_q.weight", "attn_k.weight")):
            n = cfg["num_attention_heads"] if "attn_q" in name else cfg["num_key_value_heads"]
            return unpermute_rope(w, n)
        return w

    def _hf_name(self, name: str) -> str:
        if name in _TENSOR_NAMES:
            return _TENSOR_NAMES[name]
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) == 5 and parts[2] == "nextn":
            # A multi-token-prediction layer's own tensors (GLM-4.5): under its layer's HF
            # name, which the family's rules skip.
            return f"model.layers.{parts[1]}.{parts[3]}.{parts[4]}"
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in self._blocks:
            layer, base, kind = parts[1], parts[2], parts[3]
            return f"model.layers.{layer}.{self._blocks[base]}.{kind}"
        raise ModelLoadError(f"unsupported tensor {name!r} in {self.path.name} ({self.arch})")

    def tokenizer(self):
        """A `PreTrainedTokenizerFast` rebuilt from the file's vocabulary, merges, special tokens
        and chat template (transformers' GGUF converters; no torch needed), or the one a
        previous start built from the same metadata (`converters.tokenizer_cache`)."""
        tok_meta = {k: v for k, v in self.meta.items() if k.startswith("tokenizer.")}
        return cached_tokenizer({"arch": self.arch, **tok_meta}, self._build_tokenizer)

    def _build_tokenizer(self):  # reads the architecture and the tokenizer.* metadata only
        import_transformers()
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf import gguf_tokenizer_mapping as gtm

        groups = {
            group: {
                name: self.meta[f"tokenizer.{key}"]
                for key, name in renames.items()
                if f"tokenizer.{key}" in self.meta
            }
            for group, renames in gtm.GGUF_TOKENIZER_MAPPING.items()
        }
        tok_dict, tok_cfg = groups["tokenizer"], groups["tokenizer_config"]
        if "tokens" not in tok_dict:
            raise ModelLoadError(f"{self.path.name} has no tokenizer vocabulary")
        backend, _ = gtm.convert_gguf_tokenizer(self.arch, tok_dict)
        special = {}
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
            token_id = self.meta.get(f"tokenizer.ggml.{key}")
            if token_id is not None:
                special[name] = tok_dict["tokens"][int(token_id)]
        add_bos = tok_cfg.get("add_bos_token", tok_dict.get("tokenizer_type") == "llama")
        tok = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            add_bos_token=bool(add_bos),
            add_eos_token=bool(tok_cfg.get("add_eos_token", False)),
            **special,
        )
        if tok_cfg.get("chat_template"):
            tok.chat_template = tok_cfg["chat_template"]
        return tok


# Tensors that hf_config reads into the rope settings.
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
