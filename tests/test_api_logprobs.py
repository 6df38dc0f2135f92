"""Logprobs, n choices and their error cases as the official openai client sees them: a real
`glm53 serve` (granian) on 127.0.0.1 with the scripted engine. Its logits are known exactly (see
glm53/engine/scripted.py): 0 on the scripted token and -inf elsewhere (so a generated token's
logprob is 0 and every other token's -9999.0, OpenAI's stand-in for -inf), and a prompt position
is uniform (logprob -log(vocab_size))."""

import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from serving_kit import VOCAB_SIZE, scripted_server

MODEL = "glm-5.3-flash"
SCRIPT = {"default": "</think>Hello there.", "replies": [{"when": "@count", "text": "one two"}]}
UNIFORM = -math.log(VOCAB_SIZE)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = scripted_server(
        tmp_path_factory.mktemp("logprobs"), SCRIPT, "--max-batch", "2", "--chunk-size", "16"
    )
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)


def tokenize(server, text):
    return httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]


def detokenize_each(server, ids):
    """Each token's text through /v1/completions' own echo (one id a request)."""
    out = []
    for token in ids:
        answer = httpx.post(
            server.url + "/v1/completions",
            json={"model": MODEL, "prompt": [token], "max_tokens": 0, "echo": True},
        ).json()
        out.append(answer["choices"][0]["text"])
    return out


def test_chat_logprobs_give_each_token_its_logprob_bytes_and_top_alternatives(client, server):
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=3,
    )
    content = answer.choices[0].logprobs.content
    tokens = tokenize(server, "</think>Hello there.")
    assert len(content) == len(tokens) + 1 == answer.usage.completion_tokens  # + eos
    assert "".join(e.token for e in content[:-1]) == "</think>Hello there."
    for entry in content:
        assert entry.logprob == 0.0
        assert entry.bytes == list(entry.token.encode())
        assert [t.logprob for t in entry.top_logprobs] == [0.0, -9999.0, -9999.0]
        assert entry.top_logprobs[0].token == entry.token


def test_streamed_chat_logprobs_equal_the_plain_ones(client):
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
        "top_logprobs": 2,
    }
    plain = client.chat.completions.create(**request).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(**request, stream=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in plain]


def test_chat_without_logprobs_has_none(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    assert answer.choices[0].logprobs is None


def test_tokens_as_token_ids(client, server):
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True},
    )
    ids = [int(e.token.removeprefix("token_id:")) for e in answer.choices[0].logprobs.content]
    assert ids[:-1] == tokenize(server, "</think>Hello there.")


def test_completion_echo_with_max_tokens_0_scores_the_prompt_only(client, server):
    ids = tokenize(server, "@count me in")
    answer = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    choice = answer.choices[0]
    assert (choice.text, choice.finish_reason) == ("@count me in", "length")
    assert answer.usage.completion_tokens == 0
    lp = choice.logprobs
    assert "".join(lp.tokens) == "@count me in"
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([UNIFORM] * (len(ids) - 1), abs=1e-6)
    # a uniform row: the top two are the two smallest ids
    names = detokenize_each(server, [0, 1])
    for top in lp.top_logprobs[1:]:
        assert top == pytest.approx(dict.fromkeys(names, UNIFORM), abs=1e-6)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_completion_logprobs_with_echo_cover_prompt_then_answer(client, server):
    prompt = "@count"
    answer = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=0, temperature=0
    )
    lp = answer.choices[0].logprobs
    n_prompt = len(tokenize(server, prompt))
    assert answer.choices[0].text == "@countone two"
    assert len(lp.tokens) == n_prompt + 3
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[n_prompt:] == [0.0, 0.0, 0.0]
    assert all(t == {} for t in lp.top_logprobs[1:])


def test_streamed_completion_logprobs_equal_the_plain_ones(client):
    request = {"model": MODEL, "prompt": "@count", "max_tokens": 3, "echo": True, "logprobs": 1}
    plain = client.completions.create(**request).choices[0].logprobs
    chunks = list(client.completions.create(**request, stream=True))
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs:
            for key in merged:
                merged[key].extend(getattr(chunk.choices[0].logprobs, key))
    assert merged == plain.model_dump()
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "@countone two"


def test_generate_logprobs_in_sglang_meta_info(server):
    ids = tokenize(server, "@count it")
    answer = httpx.post(
        server.url + "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 1,
            "top_logprobs_num": 1,
        },
    ).json()
    meta = answer["meta_info"]
    out = answer["output_ids"]
    assert meta["output_token_logprobs"] == [[0.0, out[0], None], [0.0, out[1], None]]
    assert [t[0][:2] for t in meta["output_top_logprobs"]] == [[0.0, out[0]], [0.0, out[1]]]
    assert [row[1] for row in meta["input_token_logprobs"]] == ids[1:]
    assert [row[0] for row in meta["input_token_logprobs"]] == pytest.approx(
        [UNIFORM] * (len(ids) - 1), abs=1e-6
    )
    assert all(top[0][1] == 0 for top in meta["input_top_logprobs"])


def test_prompt_logprobs_span_prefill_chunks_and_keep_their_order(server):
    text = "@count " + " ".join(f"word{i}" for i in range(40))
    ids = tokenize(server, text)
    assert len(ids) > 3 * 16  # several 16-token chunks
    meta = httpx.post(
        server.url + "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1},
            "return_logprob": True,
            "logprob_start_len": 20,
        },
    ).json()["meta_info"]
    assert [row[1] for row in meta["input_token_logprobs"]] == ids[20:]
    assert [row[0] for row in meta["input_token_logprobs"]] == pytest.approx(
        [UNIFORM] * (len(ids) - 20), abs=1e-6
    )


def test_generate_without_logprob_start_len_returns_output_logprobs_only(server):
    answer = httpx.post(
        server.url + "/generate",
        json={
            "text": "@count",
            "sampling_params": {"max_new_tokens": 1},
            "return_logprob": True,
            "return_text_in_logprobs": True,
        },
    ).json()
    meta = answer["meta_info"]
    assert meta["output_token_logprobs"] == [[0.0, answer["output_ids"][0], "one"]]
    assert "input_token_logprobs" not in meta and "output_top_logprobs" not in meta


def test_n_choices_run_in_parallel_plain_and_streamed(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2
    )
    assert [c.index for c in answer.choices] == [0, 1]
    assert {c.message.content for c in answer.choices} == {"Hello there."}
    single = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    assert answer.usage.completion_tokens == 2 * single.usage.completion_tokens
    assert answer.usage.prompt_tokens == single.usage.prompt_tokens
    chunks = list(
        client.completions.create(model=MODEL, prompt="@count", n=2, max_tokens=5, stream=True)
    )
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == {0: "one two", 1: "one two"}


def test_n_above_max_batch_names_n_and_the_flag(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", n=3)
    assert info.value.param == "n"
    assert "n=3 is more than --max-batch 2" in info.value.message


def test_top_logprobs_above_20_is_refused(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            logprobs=True,
            top_logprobs=21,
        )
    assert info.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", logprobs=21)
    assert info.value.param == "logprobs"


def test_max_tokens_0_without_echo_is_refused(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert info.value.param == "max_tokens" and "echo" in info.value.message


def test_logprobs_overhead_bench_prints_its_contract(server):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "logprobs_overhead.py"), "--json",
         "--url", server.url, "--tokens", "4", "--rounds", "1"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "logprobs_overhead"
    assert set(result["figures"]["runs"]) == {"plain", "logprobs"}
    assert result["ratios"]["logprobs_over_plain"] > 0
    # the CPU engine: asking for logprobs changes no greedy token, and each token has its top K
    assert result["figures"]["same_tokens_with_logprobs"] is True
    assert result["figures"]["every_token_has_top_k"] is True
