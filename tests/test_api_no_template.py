"""A checkpoint without a chat template serves /v1/completions and /generate; chat answers a
400 that names what is missing (real server, scripted engine, official openai client)."""

import json

import httpx
import openai
import pytest
from serving_kit import Server, write_script, write_tokenizer_checkpoint


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("no-template")
    checkpoint = write_tokenizer_checkpoint(tmp / "checkpoint")
    (checkpoint / "chat_template.jinja").unlink()
    config_path = checkpoint / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["chat_template"]
    config_path.write_text(json.dumps(config))
    script = write_script(tmp / "script.json", {"default": "plain words"})
    args = ["--engine", "scripted", "--script", str(script), "--model", str(checkpoint)]
    server = Server(args, log_path=tmp / "server.log")
    server.wait_ready()
    server.checkpoint = checkpoint
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)


def test_completions_and_generate_work_without_a_chat_template(client, server):
    answer = client.completions.create(model="glm-5.3-flash", prompt="hello", max_tokens=10)
    assert answer.choices[0].text == "plain words"
    generated = httpx.post(server.url + "/generate", json={"text": "hello"}).json()
    assert generated["text"] == "plain words"


def test_chat_without_a_chat_template_is_a_400_naming_the_file(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="glm-5.3-flash", messages=[{"role": "user", "content": "hi"}]
        )
    assert info.value.param == "messages"
    assert f"{server.checkpoint} has no chat template" in info.value.message
    assert "chat_template.jinja" in info.value.message
