"""``run.py --html``: the step-through page, loaded in a real browser (Debian's headless
``chromium``, driven over the DevTools protocol on a pipe), shows at each step exactly what the
engines held after that step: their hash counters and every sequence's block table.

Every test first checks what needs no browser: the data the page embeds, against what the
engines held. Without a chromium on PATH the browser half is not run and the run's summary says
so ("NOT CHECKED: ..."); ``.ci/run`` installs chromium and sets ``STEP14_REQUIRE_BROWSER=1``,
under which a missing browser fails the test instead."""
from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from teaching import step_page

PNG = b"\x89PNG\r\n\x1a\n"


class Browser:
    """Headless Chromium driven over the DevTools protocol on fds 3 (commands) and 4 (replies)."""

    def __init__(self, profile: Path) -> None:
        binary = step_page.find_chromium()
        cmd_read, self.cmd_write = os.pipe()
        self.reply_read, reply_write = os.pipe()

        def wire_pipe():  # in the child: the protocol's fixed fds 3 and 4
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (cmd_read, reply_write)]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)
        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
             f"--user-data-dir={profile}", "--window-size=1400,1000", "about:blank"],
            preexec_fn=wire_pipe, close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(cmd_read)
        os.close(reply_write)
        self.next_id, self.buffer, self.session = 0, b"", None

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        message = dict(id=self.next_id, method=method, params=params)
        if self.session and not method.startswith("Target."):
            message["sessionId"] = self.session
        os.write(self.cmd_write, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") == self.next_id:
                assert "error" not in reply, reply
                return reply["result"]

    def _read_message(self) -> dict:
        while b"\0" not in self.buffer:
            chunk = os.read(self.reply_read, 1 << 16)
            assert chunk, "chromium closed the DevTools pipe"
            self.buffer += chunk
        raw, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(raw)

    def open(self, url: str) -> None:
        """A fresh tab on ``url``, loaded and drawn."""
        target = self.call("Target.createTarget", url=url)["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for _ in range(200):
            if self.js("document.readyState === 'complete' && document.getElementById('step-label')"
                       ".textContent !== ''"):
                return
        raise AssertionError(f"{url} did not load")

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"]
        return result.get("value")

    def shown(self) -> dict:
        """What the page shows now, as text read off the DOM."""
        return json.loads(self.js(READ_PAGE))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)
        os.close(self.cmd_write)
        os.close(self.reply_read)


READ_PAGE = """JSON.stringify({
  label: document.getElementById('step-label').textContent,
  hash: location.hash,
  counters: Object.fromEntries([...document.querySelectorAll('#counter-rows td[id]')]
                                .map(td => [td.id, td.textContent])),
  seqs: [...document.querySelectorAll('.seq')].map(s => [s.querySelector('.seq-id').textContent,
                                                           s.querySelector('.seq-table').textContent]),
  pool: [...document.querySelectorAll('.block')].map(b => [b.querySelector('.block-id').textContent,
                                                           b.querySelector('.block-ref').textContent]),
  story: [...document.querySelectorAll('#story li')].map(li => li.textContent),
  state: document.getElementById('state').textContent,
  view: document.querySelector('input[name=view]:checked').value,
  log: [...document.querySelectorAll('#run-lines li')].map(li => [+li.dataset.first, +li.dataset.last,
                                                                   li.className, li.textContent]),
  events: Object.fromEntries(['recompute', 'incremental'].map(s => [s,
    [...document.querySelectorAll('#events-' + s + ' li b')].map(b => b.textContent)])),
})"""


@pytest.fixture(scope="module")
def recorded(llama_dir, tmp_path_factory):
    """The page's run, and what the engines themselves held after every step."""
    truth = {}

    def keep(strategy, step, recorder):
        llm, events = recorder.llm, recorder.events  # every event of the engine since it was built
        seqs = list(llm.scheduler.running) + list(llm.scheduler.waiting)
        truth[strategy, step] = dict(
            hashes=llm.prefix_cache.hash_computations, stats=llm.stats(),
            tables=[(s.request_id, list(s.block_table)) for s in seqs],
            refs=[b.ref_count for b in llm.block_manager.blocks],
            running=[s.request_id for s in llm.scheduler.running],
            waiting=[s.request_id for s in llm.scheduler.waiting],
            events=[(e.kind, e.request_id) for e in events[keep.seen[strategy]:]],
            reasons=[str(e.reason) for e in events[keep.seen[strategy]:] if e.kind == "miss"],
            kinds=Counter(e.kind for e in events[keep.seen[strategy]:]))
        keep.seen[strategy] = len(events)
    keep.seen = dict.fromkeys(step_page.STRATEGIES, 0)
    data = step_page.record(llama_dir, dict(device="cpu", dtype="float32"), on_step=keep)
    page = tmp_path_factory.mktemp("page") / "steps.html"
    page.write_text(step_page.render(data), encoding="utf-8")
    return data, truth, page


NO_BROWSER = "the step page in a real browser (chromium not found; .ci/run installs it)"


@pytest.fixture(scope="module")
def chromium_browser(tmp_path_factory):
    """The browser, or None where no chromium is on PATH (a failure under STEP14_REQUIRE_BROWSER)."""
    if step_page.find_chromium() is None:
        if os.environ.get("STEP14_REQUIRE_BROWSER") == "1":
            pytest.fail("STEP14_REQUIRE_BROWSER=1 but no chromium on PATH (Debian: apt-get install chromium)")
        yield None
        return
    b = Browser(tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


@pytest.fixture
def browser(chromium_browser, not_checked):
    """The module's browser; without one, the test's browser half is noted as not checked."""
    if chromium_browser is None:
        not_checked(NO_BROWSER)
    return chromium_browser


def step_of(truth: dict, strategy: str, kind: str) -> int:
    """The first step at which the engine recorded an event of ``kind``."""
    return min(step for (s, step), t in truth.items() if s == strategy and t["kinds"][kind])


def assert_shows(shown: dict, truth: dict, step: int, view: str, steps: int) -> None:
    """The page's text at ``step`` equals what the engines held after that step."""
    assert shown["label"] == f"step {step} of {steps}"
    assert shown["hash"] == f"#step={step}" + ("&view=recompute" if view == "recompute" else "")
    assert shown["view"] == view
    for strategy in step_page.STRATEGIES:
        t = truth[strategy, step]
        calls = t["hashes"] - (truth[strategy, step - 1]["hashes"] if step > 1 else 0)
        assert shown["counters"][f"hash_computations-{strategy}"] == str(t["hashes"])
        assert shown["counters"][f"hash_step-{strategy}"] == str(calls)
        for key in ("evictions", "preemptions", "prefix_cache_hits"):
            assert shown["counters"][f"{key}-{strategy}"] == str(t["stats"][key])
        events = shown["events"][strategy]
        assert Counter(events) == t["kinds"]
        assert events.count("hash") == calls
    tables = [(re.fullmatch(r"request (\S+)", seq)[1], [int(b) for b in re.findall(r"\d+", table)])
              for seq, table in shown["seqs"]]
    assert tables == truth[view, step]["tables"]
    assert [int(ref.split()[1]) for _, ref in shown["pool"]] == truth[view, step]["refs"]


def assert_tells(shown: dict, data: dict, step: int, view: str) -> None:
    """The page tells the recorded story of ``step`` (a decode-only stretch as its one line),
    the state line, and marks the step's line of the run's log."""
    story = data["steps"][step - 1][view]["story"]
    stretch = next((r for r in data["stretches"][view] if r["first"] <= step <= r["last"]), None)
    assert shown["story"] == ([stretch["line"]] if story["decode_only"] else story["lines"])
    assert shown["state"] == story["state"]
    current = [(first, last) for first, last, cls, _ in shown["log"] if cls == "current"]
    assert len(current) == 1 and current[0][0] <= step <= current[0][1]
    folded = sum(r["last"] - r["first"] for r in data["stretches"][view])
    assert len(shown["log"]) == len(data["steps"]) - folded


def step_facts(truth: dict, strategy: str, step: int) -> dict:
    """What the engine did at ``step``, from its own queues and events (not from the page)."""
    now, before = truth[strategy, step], truth.get((strategy, step - 1))
    ran = before["running"] if before else []
    was = set(ran) | set(before["waiting"] if before else [])
    by_kind = lambda kind: {r for k, r in now["events"] if k == kind}
    return dict(
        preempted=[r for r in ran if r in now["waiting"]],
        admitted=[r for r in now["running"] if r not in ran],
        finished=[r for r in was if r not in now["running"] + now["waiting"]],
        waits=by_kind("wait"),
        no_room=[r for r in now["waiting"] if r in by_kind("hit") | by_kind("miss") and r not in by_kind("wait")],
        preemptions=now["stats"]["preemptions"] - (before["stats"]["preemptions"] if before else 0))


def assert_story_is_the_engines(data: dict, truth: dict, step: int, strategy: str) -> None:
    """Every preemption, admission, in-flight wait, no-room wait and finish the engine made at
    ``step`` is told, and the state line counts what the pool held."""
    story, facts = data["steps"][step - 1][strategy]["story"], step_facts(truth, strategy, step)
    starts = lambda prefix: [line for line in story["lines"] if line.startswith(prefix)]
    assert len([line for line in story["lines"] if " is preempted: " in line]) == facts["preemptions"]
    for rid in facts["preempted"]:
        assert starts(f"request {rid} is preempted: ")
    for rid in facts["admitted"]:
        assert starts(f"request {rid} admitted: ") or starts(f"request {rid} re-admitted after its preemption: ")
    for rid in facts["waits"]:
        assert "in flight" in starts(f"request {rid} waits: ")[0]
    for rid in facts["no_room"]:  # with the numbers the scheduler decided on
        line, = starts(f"request {rid} stays waiting, no room: ")
        assert ", but it needs " in line and " had ref count 0" in line, line
    for rid in facts["finished"]:
        assert starts(f"request {rid} finishes: ")
    quiet = not truth[strategy, step]["events"] and not any(facts[k] for k in facts if k != "preemptions")
    assert story["decode_only"] == (quiet and not facts["preemptions"])
    refs, t = truth[strategy, step]["refs"], truth[strategy, step]
    assert story["state"].startswith(f"After this step: {sum(r > 0 for r in refs)} pool blocks in use, ")
    shared = [str(i) for i, r in enumerate(refs) if r > 1]
    assert (f"shared (ref count > 1): blocks {' '.join(shared)}." in story["state"]) if shared else \
        "no block is shared" in story["state"]
    assert story["state"].endswith(f"Requests running: {', '.join(t['running']) or 'none'}; "
                                   f"waiting: {', '.join(t['waiting']) or 'none'}.")


def assert_data_shows(data: dict, truth: dict, step: int, view: str) -> None:
    """The page's embedded data at ``step`` equals what the engines held after that step."""
    for strategy in step_page.STRATEGIES:
        snap, t = data["steps"][step - 1][strategy], truth[strategy, step]
        calls = t["hashes"] - (truth[strategy, step - 1]["hashes"] if step > 1 else 0)
        assert snap["counters"]["hash_computations"] == t["hashes"]
        assert snap["counters"]["hash_step"] == calls
        for key in ("evictions", "preemptions", "prefix_cache_hits"):
            assert snap["counters"][key] == t["stats"][key]
        assert Counter(e["kind"] for e in snap["events"]) == t["kinds"]
        assert t["kinds"]["hash"] == calls
    snap = data["steps"][step - 1][view]
    assert [(s["id"], s["table"]) for s in snap["seqs"]] == truth[view, step]["tables"]
    assert [b["ref"] for b in snap["pool"]] == truth[view, step]["refs"]


def embedded_data(page: Path) -> dict:
    """The JSON the page's script reads, taken back out of the HTML."""
    html = page.read_text(encoding="utf-8")
    match = re.search(r'<script id="data" type="application/json">(.*?)</script>', html, re.S)
    return json.loads(match[1])


def first_preemption(truth: dict) -> int:
    return min(step for (s, step), t in truth.items() if s == "incremental" and t["stats"]["preemptions"])


def test_workload_plays_every_scene(recorded):
    data, truth, _ = recorded
    last = len(data["steps"])
    for strategy in step_page.STRATEGIES:
        kinds = sum((t["kinds"] for (s, _), t in truth.items() if s == strategy), Counter())
        assert {"hash", "hit", "miss", "wait", "save", "twin", "evict"} <= set(kinds), kinds
        assert kinds["hash"] == truth[strategy, last]["hashes"]  # one "hash" event per call
        assert (kinds["reuse"] > 0) == (strategy == "incremental")  # a hash read, no call
        assert truth[strategy, last]["stats"]["preemptions"] >= 1
    assert truth["recompute", last]["hashes"] > truth["incremental", last]["hashes"]
    follow_up = [s for s in data["steps"] if s["incremental"]["scene"] == "follow-up"]
    decode_hits = [e for s in follow_up for e in s["incremental"]["events"]
                   if e["kind"] == "hit" and (e["index"] + 1) * 4 > 19]  # request 0's prompt: 19 tokens
    assert decode_hits, "the follow-up turn hits a block completed during decode"


def test_every_lookup_on_the_page_says_why_it_stopped(recorded):
    """Each "miss" event the page shows carries the engine's reason, and the story of an admitted or
    waiting-for-room request says where its lookup stopped and why."""
    data, truth, _ = recorded
    told = 0
    for n, step in enumerate(data["steps"], 1):
        for strategy in step_page.STRATEGIES:
            misses = [e for e in step[strategy]["events"] if e["kind"] == "miss"]
            assert [e["reason"] for e in misses] == truth[strategy, n]["reasons"]
            lines = step[strategy]["story"]["lines"]
            for e in misses:
                line = next(line for line in lines if line.startswith(f"request {e['req']} ")
                            and " is preempted: " not in line)
                if " waits: " not in line:
                    assert f"it stops at {e['reason']}" in line, line
                    told += 1
    assert told >= 10


def test_page_fetches_nothing(recorded):
    html = recorded[2].read_text()
    for needle in ("http://", "https://", " src=", "<link", "fetch(", "XMLHttpRequest", "import("):
        assert needle not in html


def test_story_of_every_step_is_the_engines(recorded):
    """The narration, checked against the engines' own queues, events and pool at every step;
    the run has each thing to tell: a preemption, an in-flight wait, a request left waiting for
    room after hits, and decode-only stretches folded into one line each."""
    data, truth, _ = recorded
    steps = len(data["steps"])
    for strategy in step_page.STRATEGIES:
        for step in range(1, steps + 1):
            assert_story_is_the_engines(data, truth, step, strategy)
        facts = [step_facts(truth, strategy, n) for n in range(1, steps + 1)]
        no_room = [n for n, f in enumerate(facts, 1) for r in f["no_room"]
                   if ("hit", r) in truth[strategy, n]["events"]]
        assert no_room and any(f["preempted"] for f in facts) and any(f["waits"] for f in facts)
        assert any(r["last"] > r["first"] for r in data["stretches"][strategy])


def test_page_embeds_every_steps_data(recorded):
    """What the script will parse is the recorded run, whole, and matches the engines' state."""
    data, truth, page = recorded
    assert embedded_data(page) == json.loads(json.dumps(data))
    for step in range(1, len(data["steps"]) + 1):
        assert_data_shows(data, truth, step, "incremental")
        assert_data_shows(data, truth, step, "recompute")


@pytest.mark.parametrize("event", ["wait", "twin", "evict"])
def test_page_opened_at_a_step_shows_the_engines_state(recorded, browser, event):
    data, truth, page = recorded
    step = step_of(truth, "incremental", event)
    assert event in Counter(e["kind"] for e in data["steps"][step - 1]["incremental"]["events"])
    assert_data_shows(embedded_data(page), truth, step, "incremental")
    if browser is None:
        return
    browser.open(f"{page.as_uri()}#step={step}")
    assert_shows(browser.shown(), truth, step, "incremental", len(data["steps"]))
    assert event in browser.shown()["events"]["incremental"]
    assert_tells(browser.shown(), data, step, "incremental")
    browser.js("document.getElementById('view-recompute').click()")
    assert_shows(browser.shown(), truth, step, "recompute", len(data["steps"]))
    assert_tells(browser.shown(), data, step, "recompute")


def test_recompute_view_has_its_own_link(recorded, browser):
    """``#step=N&view=recompute`` opens the recompute engine's pool and chains at step N, and the
    preemption is told there in words, not only as a counter."""
    data, truth, page = recorded
    step = first_preemption(truth)
    assert any(" is preempted: " in line for line in data["steps"][step - 1]["recompute"]["story"]["lines"])
    if browser is None:
        return
    browser.open(f"{page.as_uri()}#step={step}&view=recompute")
    shown = browser.shown()
    assert_shows(shown, truth, step, "recompute", len(data["steps"]))
    assert_tells(shown, data, step, "recompute")
    assert any(" is preempted: " in line for line in shown["story"])


def test_buttons_and_slider_step_through_the_run(recorded, browser):
    data, truth, page = recorded
    steps = len(data["steps"])
    preempted = first_preemption(truth)
    assert_data_shows(data, truth, preempted, "incremental")
    if browser is None:
        return
    browser.open(page.as_uri())
    assert_shows(browser.shown(), truth, 1, "incremental", steps)
    for step in range(2, steps + 1):
        browser.js("document.getElementById('next').click()")
        assert_shows(browser.shown(), truth, step, "incremental", steps)
        assert_tells(browser.shown(), data, step, "incremental")
    browser.js("document.getElementById('next').click()")  # past the end: stays on the last step
    assert browser.shown()["label"] == f"step {steps} of {steps}"
    browser.js("document.getElementById('prev').click()")
    assert_shows(browser.shown(), truth, steps - 1, "incremental", steps)
    browser.js(f"const s = document.getElementById('slider'); s.value = {preempted};"
               "s.dispatchEvent(new Event('input'))")
    assert_shows(browser.shown(), truth, preempted, "incremental", steps)


def test_screenshot_of_one_step(recorded, tmp_path, browser):
    data, _, page = recorded
    png = tmp_path / "step.png"
    step = step_page.busiest_step(data)
    kinds = [{e["kind"] for e in s["incremental"]["events"]} for s in data["steps"]]
    assert len(kinds[step - 1]) == max(map(len, kinds))
    if browser is None:  # what run.py --png says on such a machine
        with pytest.raises(RuntimeError, match="no chromium found"):
            step_page.screenshot(page, png, step)
        return
    step_page.screenshot(page, png, step)
    assert png.read_bytes()[:8] == PNG and png.stat().st_size > 20_000
