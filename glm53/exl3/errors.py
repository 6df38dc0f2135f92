"""Errors of the adapter over exllamav3 that a user causes or fixes. Each keeps RuntimeError as
its built-in base (what these loads raised before) and says what to change. Internal invariant
failures stay plain RuntimeErrors whose message starts with "internal error"."""

from glm53.errors import Glm53Error


class Exl3Refused(RuntimeError, Glm53Error):
    """exllamav3 cannot run what the settings ask on this host: too little VRAM or locked
    memory, a GPU that is not there, a path the settings pick that the checkpoint cannot take.
    The message names the setting or the limit, and the fix."""


class UnsupportedCheckpoint(Exl3Refused):
    """The checkpoint is laid out in a way glm53 does not load (not an EXL3 mixture of experts
    with one size per routed expert, or a config.json that disagrees with its tensors)."""
