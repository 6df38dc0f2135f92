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
    # the kill's time beside a failed one: a plain request in flight on the killed replica is
    # the suspect of the rare failure seen once on 2026-12-01 (see the issue note)
    assert [o for o in plain if not o.ok] == [], f"kill at {run.kill_s}, rejoin at {run.rejoin_s}"
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
