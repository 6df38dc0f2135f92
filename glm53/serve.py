"""`glm53 serve`: the OpenAI-compatible server. granian runs one worker process that owns the
engine; the app loads the model in its lifespan (in the background, /health answers 503 until
it is ready), and a failed load stops the worker, so granian exits 1 after logging the reason."""

from __future__ import annotations

import argparse
import copy
import functools
import ipaddress
import logging
import logging.config
import math
import os
import signal
import sys

from glm53 import config

log = logging.getLogger("glm53.serve")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve GLM-5.3-Flash over an OpenAI-compatible HTTP API. Without --model it "
        "serves the synthetic demo checkpoint on the CPU engine. Every flag has a GLM53_* "
        "environment twin; a flag wins over the environment, which wins over the default.",
    )
    config.add_arguments(parser)
    parser.set_defaults(func=main)


def _logging_config(level: str) -> dict:
    from granian.log import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["formatters"]["generic"]["fmt"] = "[%(asctime)s] %(levelname)s %(name)s: %(message)s"
    cfg["formatters"]["generic"]["datefmt"] = "%Y-%m-%d %H:%M:%S"
    cfg["loggers"]["glm53"] = {"handlers": ["console"], "level": level.upper(), "propagate": False}
    return cfg


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _what_is_served(settings: config.Settings) -> str:
    from glm53.engine import demo_dir, engine_kind, uses_demo

    kind = engine_kind(settings)
    if uses_demo(settings):
        return (
            f"serving the synthetic demo checkpoint (random weights: its text is gibberish) from "
            f"{demo_dir(settings)} on the {kind} engine"
        )
    return f"serving {settings.model} on the {kind} engine"


def _stop_worker() -> None:
    # SIGINT, not SIGTERM: the app took SIGTERM over for the drain, and SIGINT is still
    # granian's own stop (the listener closes, the lifespan shutdown runs, the worker exits).
    os.kill(os.getpid(), signal.SIGINT)


def _stop_worker_after_failed_load(exc: BaseException) -> None:
    # The app has logged why the load failed. Ending the worker makes granian's main process
    # exit with status 1, which is what `systemctl` and scripts see.
    _stop_worker()


def load_app(settings_json: bytes):
    """granian's target loader, run inside the worker process."""
    from glm53.api.app import App

    settings, sources = config.from_json(settings_json)
    # The engine thread and the event loop share the GIL. When the engine thread wakes from a
    # step while the loop is busy writing streams, it waits up to the switch interval for the
    # GIL (5 ms by default); 0.5 ms bounds what that wait adds to every token.
    sys.setswitchinterval(0.0005)
    return App(
        settings,
        sources,
        on_load_failed=_stop_worker_after_failed_load,
        on_drained=_stop_worker,
        freeze_heap=True,  # this process serves until it exits
    )


def main(args: argparse.Namespace) -> int:
    from glm53.engine import refuse_unbuilt, refuse_unservable

    try:
        settings, sources = config.resolve(args)
        refuse_unbuilt(settings)
        refuse_unservable(settings)  # before granian binds the port
    except config.ConfigurationError as exc:
        print(f"glm53 serve: {exc}", file=sys.stderr)
        return 2
    logging.config.dictConfig(_logging_config(settings.log_level))
    log.info("glm53 serve: %s", _what_is_served(settings))
    for line in config.describe(settings, sources):
        log.info("setting %s", line)
    if not _is_loopback(settings.host) and not settings.api_key:
        log.warning(
            "listening on %s without --api-key: anyone who can reach this port can use the model",
            settings.host,
        )
    if (
        settings.model
        and not settings.demo
        and not os.path.isfile(os.path.join(settings.model, "config.json"))
    ):
        log.error(
            "--model %s: no config.json there; point --model at a checkpoint directory",
            settings.model,
        )
        return 2
    if settings.engine == "scripted" and not (settings.script and os.path.isfile(settings.script)):
        log.error("--engine scripted needs --script FILE; %r is not a file", settings.script)
        return 2

    from granian import Granian
    from granian.constants import HTTPModes, Interfaces, Loops

    try:
        import uvloop  # noqa: F401

        loop = Loops.uvloop
    except ImportError:
        loop = Loops.asyncio
    server = Granian(
        "glm53.api.app:App",
        address=settings.host,
        port=settings.port,
        interface=Interfaces.ASGI,
        workers=1,
        http=HTTPModes.http1,  # disconnects are reliably reported on HTTP/1.1
        loop=loop,
        backpressure=max(256, 2 * (settings.max_batch + settings.queue_limit)),
        log_level=settings.log_level,
        log_dictconfig=_logging_config(settings.log_level),
        log_access=settings.access_log,
        # granian's main process waits this long for the draining worker, then kills it
        workers_kill_timeout=math.ceil(settings.drain_timeout + settings.drain_grace) + 30,
    )
    server.serve(
        target_loader=functools.partial(load_app, config.to_json(settings, sources)),
        wrap_loader=False,
    )
    return 0
