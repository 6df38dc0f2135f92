import asyncio
import threading

import pytest
import uvloop

from glm53._handoff import Handoff


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_posts_from_a_thread_run_on_the_loop_in_order(new_loop):
    async def main():
        loop = asyncio.get_running_loop()
        handoff = Handoff(loop)
        got, threads, done = [], [], asyncio.Event()

        def record(i):
            got.append(i)
            threads.append(threading.get_ident())

        def post_all():
            for i in range(2000):
                handoff.post(record, i)
            handoff.post(done.set)

        threading.Thread(target=post_all).start()
        await done.wait()
        handoff.close()
        assert got == list(range(2000))
        assert set(threads) == {threading.get_ident()}

    runner = asyncio.Runner(loop_factory=new_loop)
    with runner:
        runner.run(main())


def test_a_failing_callback_does_not_stop_the_others(caplog):
    async def main():
        handoff = Handoff(asyncio.get_running_loop())
        got = []
        handoff.post(got.append, 1)
        handoff.post(lambda: 1 / 0)
        handoff.post(got.append, 2)
        handoff.close()  # runs what is queued
        return got

    assert asyncio.run(main()) == [1, 2]
    assert "a callback posted by the engine thread failed" in caplog.text


def test_after_close_posts_are_dropped_and_close_is_idempotent():
    async def main():
        handoff = Handoff(asyncio.get_running_loop())
        got = []
        handoff.close()
        handoff.post(got.append, 1)
        handoff.close()
        await asyncio.sleep(0)
        return got

    assert asyncio.run(main()) == []
