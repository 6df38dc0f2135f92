"""Three glm53 replicas behind a real router (sglang-router, see docs/fleet.md) under a steady
load of streamed and plain requests: a SIGKILLed replica costs only the streams it was running
(each ends with an error its client sees), the restarted replica gets traffic again, and a
replica under SIGTERM drains its streams and exits 0. The run's numbers are printed (-s)."""

import json

from fleet_kit import STREAM_ANSWER, run_fleet


def test_fleet_survives_a_kill_a_restart_and_a_drain(tmp_path):
    run = run_fleet(tmp_path)
    numbers = run.numbers()
    print("fleet:", json.dumps(numbers))
    assert run.hung_clients == 0
    plain = [o for o in run.outcomes if o.kind == "plain"]
    streams = [o for o in run.outcomes if o.kind == "stream"]
    assert plain and streams
    # a failed one is placed on the run's timeline (one failed on the CI VM 0.5 s after the
    # drained replica exited, before --drain-grace: docs/fleet.md)
    failed = [
        f"{o.start_s - run.kill_s:+.2f} to {o.end_s - run.kill_s:+.2f} s: {o.error}"
        for o in plain
        if not o.ok
    ]
    assert failed == [], f"after the kill: {run.timeline()}"
    assert all(o.text == "ok fine" and o.finish == "stop" for o in plain)
    for o in streams:
        if o.ok:  # a stream that did not raise is whole: nothing ends silently short
            assert (o.text, o.finish) == (STREAM_ANSWER, "stop"), o
        else:  # only streams running on the killed replica fail, and they fail at the kill
            assert o.start_s < run.kill_s <= o.end_s, o
            assert o.end_s - run.kill_s < 10, o
            assert "APIConnectionError" in o.error or "APIError" in o.error, o
    # streams that started after the kill, and those on the drained replica, all completed
    assert all(o.ok for o in streams if o.start_s > run.kill_s)
    assert run.rejoin_s is not None
    assert run.drain_exit_code == 0
    assert "drained in" in run.drained_replica_log
    assert "drain timeout" not in run.drained_replica_log  # its streams finished in time
