"""The expert tier system: VRAM slots, RAM tier, NVMe store, CPU lane and the controller."""
