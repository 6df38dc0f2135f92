"""glm53: GLM-5.3-Flash on one small GPU, experts tiered over VRAM, RAM, NVMe and CPU."""

from glm53._buildinfo import version as __version__

__all__ = ["__version__"]
