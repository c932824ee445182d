"""`LoRARequest`: which LoRA adapter a request runs under (vLLM's type and argument order)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter by name, id and directory.

    `lora_int_id` (positive) is the engine's key for the adapter: requests with the same id
    share its slot, host copy and prefix-cache pages, so one id must always mean one
    directory's weights. `lora_path` is read on the adapter's first use (and again if its host
    copy was dropped); it holds `adapter_config.json` and `adapter_model.safetensors`.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive int, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
