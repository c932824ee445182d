"""Image inputs, host side and JAX-free: decoding (`decode.py`), the Idefics3 / SmolVLM
processor in NumPy (`idefics3_processor.py`) and a prompt's images (`inputs.py`)."""
