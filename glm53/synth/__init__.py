"""The synthetic checkpoint writer: random-weight GLM-5.3-Flash EXL3 checkpoints (demo, slice and
deep presets) with a routing skew. It reads and writes checkpoints through glm53.models and is
used by the engine (the demo checkpoint) and the `glm53 synth` command; nothing below it
imports it."""
