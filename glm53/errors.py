"""The root of glm53's own errors: every exception class glm53 defines derives from Glm53Error
(besides the built-in class it has always derived from, so `except ValueError` and the like
keep catching what they caught), and `except Glm53Error` catches any of them.
tests/test_errors.py checks that no class is left out."""


class Glm53Error(Exception):
    """An error glm53 raises on purpose, with a message that says what is wrong (and, where
    the user can fix it, how)."""


class BuildMismatch(RuntimeError, Glm53Error):
    """glm53's native modules were built from another source than its Python code (a stale
    editable build, a half-upgraded install): the message names both sides and says to rebuild."""
