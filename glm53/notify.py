"""systemd readiness: the sd_notify datagram protocol over $NOTIFY_SOCKET, without libsystemd.

Under a `Type=notify` unit, `glm53 serve` sends READY=1 once the model is loaded and /health
answers 200, and STOPPING=1 when it begins to shut down. systemd sets NOTIFY_SOCKET to a socket
path or to `@name` (a Linux abstract socket). Without the variable (not started by systemd, or
under `Type=simple`) every call does nothing and returns False.

NOTIFY_SOCKET is systemd's protocol variable, not a glm53 setting, so it is read here rather
than in config.py. A failed send is logged and never stops the server: readiness is a report.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("glm53.notify")


def socket_address(value: str) -> str:
    """The AF_UNIX address for a NOTIFY_SOCKET value: a path, or `@name` for an abstract socket."""
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    raise ValueError(
        f"NOTIFY_SOCKET={value!r} is neither an absolute socket path nor @abstract-name "
        "(vsock notification sockets are not supported)"
    )


def notify(*fields: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send `fields` ("READY=1", "STATUS=...") to systemd as one datagram. True when sent,
    False when NOTIFY_SOCKET is unset or the send failed (the failure is logged)."""
    environ = os.environ if environ is None else environ
    value = environ.get("NOTIFY_SOCKET", "")
    if not value:
        return False
    for field in fields:
        if "=" not in field or "\n" in field:
            raise ValueError(f"notify field {field!r} must be one KEY=VALUE line")
    try:
        address = socket_address(value)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(fields).encode())
    except (OSError, ValueError) as exc:
        log.warning(
            "could not notify systemd (%s) through NOTIFY_SOCKET=%s: %s", fields, value, exc
        )
        return False
    return True


def _one_line(text: str) -> str:
    return " ".join(text.split())


def status(text: str, environ: Mapping[str, str] | None = None) -> bool:
    """STATUS=text: the line `systemctl status glm53` shows."""
    return notify(f"STATUS={_one_line(text)}", environ=environ)


def ready(text: str = "", environ: Mapping[str, str] | None = None) -> bool:
    """READY=1 (with a STATUS= line when given): `systemctl start` returns and After= units go."""
    fields = ["READY=1"] + ([f"STATUS={_one_line(text)}"] if text else [])
    return notify(*fields, environ=environ)


def stopping(environ: Mapping[str, str] | None = None) -> bool:
    """STOPPING=1: the service has begun to shut down."""
    return notify("STOPPING=1", "STATUS=stopping", environ=environ)
