"""glm53.api.offload: large requests' work waits for one of a few threads only while its client
is connected, and a full queue answers 429."""

import asyncio
import threading

import pytest

from glm53.api.errors import ApiError
from glm53.api.http import ClientGone, DisconnectWatcher
from glm53.api.offload import Offload


class Client:
    """An ASGI `receive` that reports a disconnect once `leave` is called."""

    def __init__(self):
        self.left = asyncio.Event()

    async def receive(self) -> dict:
        await self.left.wait()
        return {"type": "http.disconnect"}

    def leave(self) -> None:
        self.left.set()


def test_a_waiting_job_whose_client_leaves_never_runs():
    async def main():
        offload = Offload(num_threads=1, max_waiting=1)
        release, ran = threading.Event(), []
        first, second = Client(), Client()
        busy = asyncio.ensure_future(
            offload.run(DisconnectWatcher(first.receive), release.wait, 30)
        )
        await asyncio.sleep(0)
        waiting = asyncio.ensure_future(
            offload.run(DisconnectWatcher(second.receive), ran.append, "ran")
        )
        await asyncio.sleep(0)
        second.leave()
        with pytest.raises(ClientGone):
            await waiting
        release.set()
        assert await busy is True
        offload.close()
        assert ran == []
        assert offload.num_jobs == 0

    asyncio.run(main())


def test_a_full_queue_answers_429():
    async def main():
        offload = Offload(num_threads=1, max_waiting=1)
        release = threading.Event()
        clients = [Client() for _ in range(3)]
        jobs = [
            asyncio.ensure_future(offload.run(DisconnectWatcher(c.receive), release.wait, 30))
            for c in clients[:2]
        ]
        await asyncio.sleep(0)
        with pytest.raises(ApiError) as refused:
            await offload.run(DisconnectWatcher(clients[2].receive), release.wait, 30)
        assert refused.value.status == 429 and refused.value.code == "queue_full"
        release.set()
        assert await asyncio.gather(*jobs) == [True, True]
        offload.close()

    asyncio.run(main())
