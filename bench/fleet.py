"""The fleet scenario's numbers: three scripted glm53 replicas behind sglang-router, a steady
load of streamed and plain chat requests, one replica SIGKILLed and restarted, one drained with
SIGTERM (tests/fleet_kit.py runs it; tests/test_fleet.py checks the same run's outcomes).

    python bench/fleet.py [--json] [--load-s 1.5]

figures: requests, plain failures, stream errors (and how many were cut by the kill), the
router's retries, the restarted replica's rejoin time (its /health 200 to its first routed
chat request) and the drained replica's drain time (SIGTERM to exit). The anchor is the
drain timeout: drain_vs_timeout is the share of --drain-timeout the drain took.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from benchlib import host_fields

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from fleet_kit import NUM_CLIENTS, ROUTER_FLAGS, run_fleet  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument(
        "--load-s", type=float, default=1.5, help="seconds of load between the steps (1.5)"
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = run_fleet(Path(tmp), load_s=args.load_s)
    figures = run.numbers()
    ratios = {
        "plain_failure_rate": figures["plain_failures"] / max(1, figures["plain_requests"]),
        "drain_vs_timeout": round(figures["drain_s"] / figures["drain_timeout_s"], 3),
    }
    config = {
        "replicas": 3,
        "engine": "scripted",
        "clients": NUM_CLIENTS,
        "load_s": args.load_s,
        "router": "sglang-router 0.3.2",
        "router_flags": ROUTER_FLAGS,
        **host_fields(),
    }
    if not args.json:
        for key, value in figures.items():
            print(f"{key:28s}{value}")
        return 0
    print(json.dumps({"bench": "fleet", "figures": figures, "ratios": ratios, "config": config}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
