"""`specdecode chat` through a pseudo-terminal, as a user meets it: answers streamed with the
drafted tokens coloured, /stats with the prefix cache reused on the second turn, /reset,
/system, /temperature, Ctrl-C stops an answer without leaving, a seed fixes the text, and
Ctrl-D leaves. A tiny random pair with a chat template written in the test."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import signal
import sys
import time

import pytest

ANSI = re.compile(r"\x1b\[[0-9;]*m")
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def chat_pair(pair_dir, tmp_path_factory):
    """The tiny pair with a chat template and no end-of-text (config.json,
    generation_config.json and the tokenizer's eos_token each end an answer), so an answer runs
    to its token budget: the Ctrl-C test needs one still running when the key arrives (with an
    end-of-text the answer ended in ~40 ms and the test passed only by winning that race)."""
    root = tmp_path_factory.mktemp("chat")
    out = []
    for src, name in zip(pair_dir, ("target", "draft")):
        dst = root / name
        shutil.copytree(src, dst)
        tc = dst / "tokenizer_config.json"
        cfg = json.loads(tc.read_text()) if tc.exists() else {}
        tc.write_text(json.dumps(cfg | {"chat_template": TEMPLATE, "eos_token": None}))
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(config | {"eos_token_id": None}))
        gc = dst / "generation_config.json"
        if gc.exists():
            gc.write_text(json.dumps(json.loads(gc.read_text()) | {"eos_token_id": None}))
        out.append(dst)
    return out


class Terminal:
    """A process on a pseudo-terminal: type into it, wait for what it prints."""

    def __init__(self, argv: list[str]) -> None:
        env = dict(os.environ, TERM="xterm-256color", COLUMNS="120", OMP_NUM_THREADS="1")
        env.pop("NO_COLOR", None)
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the pty is its controlling terminal (Ctrl-C is SIGINT)
            os.execvpe(argv[0], argv, env)
        self.raw = ""
        self.pos = 0  # in the output without colour codes: where the last expect matched
        self.code: int | None = None

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def expect(self, pattern: str, timeout: float = 120.0) -> str:
        """Read until `pattern` (a regex, on the output without colour codes) appears after what
        the last expect matched; return that stretch of output (self.raw keeps the codes)."""
        end = time.monotonic() + timeout
        while True:
            m = re.search(pattern, ANSI.sub("", self.raw)[self.pos :])
            if m:
                out = ANSI.sub("", self.raw)[self.pos : self.pos + m.end()]
                self.pos += m.end()
                return out
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"timed out waiting for {pattern!r}; got:\n{ANSI.sub('', self.raw)[self.pos :]}"
                )
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.fd, 65536)
                except OSError:  # the child closed the terminal
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"the process ended before {pattern!r}; got:\n{self.raw[-2000:]}")
                self.raw += chunk.decode(errors="replace")

    def close(self) -> int:
        """Wait for the process to end (killing it after 30 s); its exit code (again on a later call)."""
        if self.code is not None:
            return self.code
        self.code = self._wait()
        os.close(self.fd)
        return self.code

    def _wait(self) -> int:
        end = time.monotonic() + 30
        while time.monotonic() < end:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            # keep the terminal drained, never blocking: a child waiting at its prompt prints
            # nothing, and a blocking read here hung CI for 80 minutes after a failed expect
            ready, _, _ = select.select([self.fd], [], [], 0.05)
            if ready:
                try:
                    os.read(self.fd, 65536)
                except OSError:
                    time.sleep(0.05)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        return -9


def chat(pair, *flags: str) -> Terminal:
    target, draft = pair
    argv = [sys.executable, "-m", "specdecode.cli", "chat", "--target", str(target), "--draft", str(draft)]
    term = Terminal(argv + ["--dtype", "fp32", *flags])
    term.expect(r"/help\s+lists\s+the\s+commands")
    term.expect(r"> ")
    return term


def test_chat_streams_coloured_answers_reuses_the_conversation_and_takes_commands(chat_pair):
    term = chat(chat_pair, "--max-tokens", "24", "--temperature", "0")
    try:
        before = len(term.raw)
        term.type("hello there, little model\r")
        term.expect(r"\n> ")
        # drafted tokens coloured: accepted (green), resampled (yellow) or bonus (bold magenta)
        assert re.search(r"\x1b\[(32|33|1;35)m", term.raw[before:]), "no coloured token in the answer"
        term.type("/stats\r")
        stats = term.expect(r"tau [0-9.]+.*\n(.*\n)?> ")
        assert re.search(r"time\s+to\s+first\s+token", stats) and "acceptance" in stats
        term.type("and another thing\r")
        term.expect(r"\n> ")
        term.type("/stats\r")
        stats = term.expect(r"tau [0-9.]+.*\n(.*\n)?> ")
        cached = int(re.search(r"(\d+)\s+of\s+them\s+from\s+the\s+prefix\s+cache", stats).group(1))
        assert cached > 0, "the second turn prefilled the first turn again"
        term.type("/temperature nope\r")
        term.expect(r"needs a number")
        term.type("/temperature 0.5\r")
        term.expect(r"temperature 0\.5")
        term.type("/system be brief\r")
        term.expect(r"system message set: be brief;\s+conversation cleared")
        term.type("/reset\r")
        term.expect(r"conversation cleared")
        term.type("/bogus\r")
        term.expect(r"unknown command /bogus.*\n> ")
        # Ctrl-D at the prompt leaves. Typed only once the prompt shows: readline takes the
        # terminal out of line mode when it starts reading, and a ^D typed before that reaches
        # it as a NUL, not an end of input (CI lost the key that way once)
        term.type("\x04")
        assert term.close() == 0
    finally:
        term.close()


def test_ctrl_c_stops_an_answer_without_leaving_the_chat(chat_pair):
    term = chat(chat_pair, "--max-tokens", "3000", "--temperature", "0")
    try:
        term.type("go on forever\r")
        term.expect(r"go on forever\r?\n\s*\S")  # the echo, then the answer has started
        term.type("\x03")  # Ctrl-C
        term.expect(r"\[stopped\]\s*\n> ")
        term.type("/exit\r")
        assert term.close() == 0
    finally:
        term.close()


@pytest.mark.heavy
def test_a_seed_fixes_the_conversation_whatever_the_drafter(chat_pair):
    """--seed: turn i drawn with seed + i under the invariant rule: the same text with the draft
    model and with no speculation at all."""

    def answers(*flags: str) -> list[str]:
        term = chat(chat_pair, "--max-tokens", "16", "--temperature", "1", "--seed", "7", *flags)
        out = []
        try:
            for message in ("first question", "second question"):
                term.type(message + "\r")
                term.expect(message + r"\r?\n")  # the terminal's echo of the line
                out.append(term.expect(r"\n> ")[: -len("\n> ")].strip())
            term.type("/exit\r")
            assert term.close() == 0
        finally:
            term.close()
        return out

    drafted = answers()
    assert drafted == answers("--method", "none")
    assert drafted[0] and drafted[0] != drafted[1]
