"""Image inputs, host side and JAX-free: decoding by Pillow (`decode.py`), the Idefics3 /
SmolVLM processor (`idefics3_processor.py`, HF's pixels exactly) and a prompt's images
(`inputs.py`)."""
