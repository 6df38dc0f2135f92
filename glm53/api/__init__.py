"""The HTTP API: an ASGI app on msgspec, served by granian (see glm53.serve)."""
