"""Fuzz every operation of /openapi.json with schemathesis against a real server: whatever the
body, the server answers without a 5xx and keeps serving."""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from serving_kit import scripted_server

from glm53.api.openapi import ENDPOINTS

SCRIPT = {
    "default": "Fine.</think>Answer.<tool_call>get_weather<arg_key>city</arg_key><arg_value>x</arg_value></tool_call>"
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = scripted_server(
        tmp_path_factory.mktemp("fuzz"), SCRIPT, "-cs", "2048", "--queue-limit", "64"
    )
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


CASES = [(m.upper(), p, "positive") for m, p, *_ in ENDPOINTS] + [
    (m.upper(), p, "negative") for m, p, body, *_ in ENDPOINTS if body is not None
]


@pytest.mark.parametrize("method, path, mode", CASES)
def test_no_operation_answers_5xx(api_schema, server, method, path, mode):
    strategy = api_schema[path][method].as_strategy(generation_mode=GenerationMode(mode))

    @settings(
        max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(case=strategy)
    def fuzz(case):
        case.call_and_validate(base_url=server.url, checks=[not_a_server_error], timeout=30)

    fuzz()


def test_server_is_idle_and_healthy_after_the_fuzzing(server):
    assert httpx.get(server.url + "/health").status_code == 200
    queue = httpx.get(server.url + "/stats").json()["queue"]
    assert queue["num_running"] == queue["num_waiting"] == queue["num_active"] == 0
