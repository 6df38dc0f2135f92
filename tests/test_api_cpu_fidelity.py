"""Logprobs, penalties, logit_bias and the fidelity tools on the real model path: `glm53 serve
--demo` on the CPU engine (the session's demo server, 16-token prefill chunks), driven by the
official openai client and by bench/score_ref_panel.py and bench/decode_kl.py as subprocesses.

The committed demo panel (reference/demo-panel.json) was made by the CPU engine itself, so
scoring the CPU engine against it is a self-consistency check of the tooling (chunked prefill
with a cache against one cache-free forward): top-1 1.0 and KL 0 within rounding."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest

from glm53.reference import REFERENCE_STACK, fingerprint, read_panel

ROOT = Path(__file__).resolve().parents[1]
PANEL = ROOT / "reference" / "demo-panel.json"
MODEL = "glm-5.3-flash"


@pytest.fixture(scope="module", autouse=True)
def same_stack_as_the_panel():
    """The CPU engine's numbers follow its stack (tests/test_reference_stack.py): under another
    one these tests would fail on numbers (top-1 0.545 under a later transformers) that look like
    a model bug. Fail first, naming the versions."""
    recorded = read_panel(PANEL).versions
    wrong = [
        f"{name} {have} is installed, the panel was made under {recorded.get(name)}"
        for name in REFERENCE_STACK
        if (have := _installed(name)).split("+")[0] != str(recorded.get(name)).split("+")[0]
    ]
    if wrong:
        pytest.fail(
            "the CPU engine's stack differs from the one reference/demo-panel.json was made "
            "under, so its numbers are not comparable: " + "; ".join(wrong) + " (pyproject.toml "
            "pins the stack; see tests/test_reference_stack.py)",
            pytrace=False,
        )


def _installed(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


@pytest.fixture(scope="module")
def client(demo_server):
    return openai.OpenAI(
        base_url=demo_server.url + "/v1", api_key="none", max_retries=0, timeout=300
    )


def run_bench(name, *args):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}.py"), "--json", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def scored(client, ids, k=20):
    """Teacher-forced top-k (id -> logprob) at each position of ids (index i scores ids[i])."""
    lp = (
        client.completions.create(
            model=MODEL,
            prompt=ids,
            max_tokens=0,
            echo=True,
            logprobs=k,
            extra_body={"return_tokens_as_token_ids": True},
        )
        .choices[0]
        .logprobs
    )
    out = [None]
    for i in range(1, len(ids)):
        top = {int(t.removeprefix("token_id:")): v for t, v in lp.top_logprobs[i].items()}
        top.setdefault(ids[i], lp.token_logprobs[i])
        out.append(top)
    return out


def test_the_demo_panel_is_of_the_demo_checkpoint(demo_server):
    panel = read_panel(PANEL)
    assert panel.checkpoint_fingerprint == fingerprint(demo_server.cache_dir / "demo-checkpoint")
    assert (panel.engine, panel.top_k) == ("cpu", 20)


def test_cpu_engine_scores_top1_1_and_kl_0_on_its_own_panel(demo_server):
    result = run_bench("score_ref_panel", "--url", demo_server.url, "--panel", str(PANEL))
    figures = result["figures"]
    assert figures["num_positions"] == sum(len(p.positions) for p in read_panel(PANEL).prompts)
    assert figures["top1_agreement"] == 1.0
    assert figures["kl_max"] < 1e-9 and figures["num_missing_support"] == 0


def test_decode_kl_of_the_cpu_engine_against_itself_is_its_rounding_floor(demo_server):
    url = demo_server.url
    result = run_bench("decode_kl", "--a", url, "--b", url, "--tokens", "6")
    figures = result["figures"]
    assert figures["num_positions"] == 4 * 6
    assert figures["top1_agreement"] == 1.0 and figures["kl_max"] < 1e-9


def test_greedy_chat_logprobs_put_the_chosen_token_first(client):
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for entry in content:
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob < 0
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)


def test_logit_bias_forces_a_token(client):
    answer = client.completions.create(
        model=MODEL,
        prompt="The",
        max_tokens=5,
        temperature=0,
        logit_bias={"300": 100},
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )
    lp = answer.choices[0].logprobs
    assert lp.tokens == ["token_id:300"] * 5
    assert all(v > -1e-6 for v in lp.token_logprobs)  # biased by +100: all the mass


@pytest.mark.parametrize("presence, frequency", [(2.0, 0.0), (0.5, 1.5)])
def test_greedy_decode_with_penalties_follows_the_penalized_argmax(
    demo_server, client, presence, frequency
):
    """Each greedy token must be the argmax of the teacher-forced logprobs minus OpenAI's
    penalty (count * frequency + presence for tokens already generated), among the top 20."""
    ids = httpx.post(demo_server.url + "/tokenize", json={"prompt": "Once upon a time"}).json()[
        "tokens"
    ]
    plain = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=20, temperature=0, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    ).choices[0].logprobs.tokens  # fmt: skip
    # A penalty changes a greedy pick only where the plain decode would repeat a token: without
    # a repeat this test cannot fail (it failed as (20, 0) when the stack changed the numbers).
    assert len(set(plain)) < len(plain), f"the plain greedy decode repeats nothing: {plain}"
    answer = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=20,  # the unpenalized greedy decode repeats a token at its 15th
        temperature=0,
        presence_penalty=presence,
        frequency_penalty=frequency,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    generated = [int(t.removeprefix("token_id:")) for t in answer.choices[0].logprobs.tokens]
    tops = scored(client, ids + generated)
    checked = changed = 0
    for j, token in enumerate(generated):
        counts = Counter(generated[:j])
        raw = tops[len(ids) + j]
        adjusted = {
            i: v - (counts[i] * frequency + presence if counts[i] else 0.0) for i, v in raw.items()
        }
        best = sorted(adjusted.values(), reverse=True)
        if best[0] - best[1] < 1e-4:  # a near-tie: rounding may pick either
            continue
        assert token == max(adjusted, key=adjusted.get), (j, generated)
        checked += 1
        changed += int(token != max(raw, key=raw.get))
    assert checked >= 14 and changed >= 1, (checked, changed)
