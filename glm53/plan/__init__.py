"""Planning, in plain Python (no torch), shared by the engines and `glm53 doctor`: what fits
where before anything loads.

- vram: exact mode's VRAM plan on one GPU (weights, KV, recurrent state, activations, reserve,
  staging buffers, expert slots);
- split: the layer split over two or more GPUs (--gpus), each device planned as vram plans one;
- host_memory, ram_cap: the RAM tier's cap (--ram-cap, or planned from this process's memory
  and its cgroup's limit) and the least it must hold;
- layer_major: layer-major prefill's hidden states, where they live and what they cost.
"""
