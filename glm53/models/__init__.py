"""Checkpoints: reading (config, safetensors headers, EXL3 tensor sets), the reference EXL3
decoder, and the synthetic checkpoint writer."""
