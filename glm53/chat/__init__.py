"""Chat: prompt rendering with the checkpoint's jinja template, and the output parser."""
