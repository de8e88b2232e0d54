"""`specdecode chat`: talk to a model, turn after turn, through the speculative engine.

Each answer is streamed as the rounds finish, every token in the colour of how it was made
(accepted draft, resampled at a rejection, the target's bonus token), as in the demo. The
conversation is kept as chat messages and rendered by the model's own chat template; with the
prefix cache on (the batch-invariant forward) a turn reuses the keys and values of every
earlier turn, so only the new message is prefilled. Commands start with a slash (/help).
Ctrl-C stops the answer being written (the part shown stays in the conversation); at the
prompt it only clears the line; Ctrl-D or /exit leaves."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from rich.console import Console
from rich.text import Text

from .core.sampling import SamplingParams
from .errors import SpecDecodeError

STYLE = {"accepted": "green", "resampled": "yellow", "bonus": "bold magenta"}

HELP = """commands:
  /stats           the last answer: time to first token, tokens/s, tokens per target forward (tau),
                   acceptance, a drafted token's cost over a target forward's (c)
  /reset           forget the conversation (the system message stays)
  /system TEXT     set the system message and start over (/system alone: none)
  /temperature T   0 = greedy; with --seed, T > 0 draws with the invariant rule: the seed fixes the text
  /help            this list
  /exit            leave (or Ctrl-D); Ctrl-C stops the answer being written"""


def stream_coloured(
    console: Console,
    run,
    tokenizer,
    tokens: list[int] | None = None,
    on_first: Callable[[], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> str:
    """Print every token a run emits (its only row) in the colour of how it was made, complete
    UTF-8 characters only, appending the ids to `tokens`; returns the text shown. on_first is
    called at the first token; when stop() turns true the row is cancelled at the next round
    boundary (the run's state stays consistent, so its prefix may still be cached)."""
    tokens = [] if tokens is None else tokens
    shown = ""
    for event in run:
        (rec,) = event.records()
        for tok, how in zip(rec.emitted_token_ids, rec.how):
            if on_first is not None and not tokens:
                on_first()
            tokens.append(tok)
            text = tokenizer.decode(tokens)
            if text.endswith("\ufffd") or not text.startswith(shown):
                continue  # an incomplete UTF-8 character: wait for the rest
            console.print(Text(text[len(shown) :], style=STYLE[how]), end="")
            shown = text
        if stop is not None and stop() and not all(event.finished):
            run.cancel(run.rows.ids)
            break
    return shown


@dataclass
class TurnStats:
    """What /stats shows of the last finished answer."""

    ttft_s: float
    tokens: int
    decode_s: float
    tau: float
    acceptance: float | None
    c: float | None
    prompt_tokens: int
    cached_tokens: int

    def lines(self) -> list[str]:
        rate = self.tokens / self.decode_s if self.decode_s > 0 else float("nan")
        out = [
            f"time to first token {self.ttft_s * 1e3:.0f} ms ({self.prompt_tokens} prompt tokens, "
            f"{self.cached_tokens} of them from the prefix cache)",
            f"{self.tokens} tokens, {rate:.1f} tokens/s after the first, "
            f"tau {self.tau:.2f} tokens per target forward",
        ]
        if self.acceptance is not None:
            c = "-" if self.c is None else f"{self.c:.2f}"
            out.append(
                f"acceptance {self.acceptance:.2f}, c {c} (a drafted token's time over a target forward's)"
            )
        return out


class ChatSession:
    """One conversation with a generator: its messages, its sampling settings and the stats of
    its last answer. `answer` streams one turn; `command` runs a slash command."""

    def __init__(
        self, gen, params: SamplingParams, system: str | None = None, console: Console | None = None
    ) -> None:
        if gen.target.tokenizer is None or not gen.target.tokenizer.chat_template:
            raise SpecDecodeError(
                "this model has no chat template (tokenizer_config.json's chat_template); "
                "chat needs one: use `specdecode generate --prompt` for plain completion"
            )
        self.gen, self.params, self.system = gen, params, system
        self.console = console or Console(highlight=False)
        self.messages: list[dict] = []
        self.last: TurnStats | None = None
        self.turns = 0

    def conversation(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    def answer(self, text: str) -> str:
        """Stream the model's answer to the user's `text`; Ctrl-C stops it at the next round
        boundary (never inside a forward, so the caches stay consistent). Returns the answer (as
        much as was written) and keeps both in the conversation."""
        stop: list[bool] = []
        old = signal.signal(signal.SIGINT, lambda *_: stop.append(True))
        try:
            return self._answer(text, stop)
        finally:
            signal.signal(signal.SIGINT, old)

    def _answer(self, text: str, stop: list[bool]) -> str:
        self.messages.append({"role": "user", "content": text})
        ids = self.gen.encode(self.conversation())
        room = self.room(len(ids))
        if room < 1:
            self.messages.pop()
            self.console.print(
                "the conversation fills the model's context; /reset to start over", style="bold red"
            )
            return ""
        params = replace(self.params, max_new_tokens=min(self.params.max_new_tokens, room))
        if params.seed is not None:  # turn i seeded seed + i: the whole conversation is fixed
            params = replace(params, seed=params.seed + self.turns)
        self.turns += 1
        start = time.perf_counter()
        first: list[float] = []
        hits_before = self._cache_hits()
        run = self.gen.stream([ids], params)
        tokens: list[int] = []
        try:
            shown = stream_coloured(
                self.console,
                run,
                self.gen.target.tokenizer,
                tokens,
                on_first=lambda: first.append(time.perf_counter()),
                stop=lambda: bool(stop),
            )
        finally:
            self.console.print()
        if stop:
            self.console.print(Text("[stopped]", style="dim"))
            self.messages.append({"role": "assistant", "content": shown})
            return shown
        (res,) = run.results()
        st = res.stats
        self.last = TurnStats(
            ttft_s=(first[0] if first else time.perf_counter()) - start,
            tokens=st.new_tokens,
            decode_s=(time.perf_counter() - first[0]) if first else 0.0,
            tau=st.tokens_per_forward,
            acceptance=st.acceptance_rate if st.drafted else None,
            c=(st.draft_s / st.drafted) / (st.target_s / st.target_forwards)
            if st.drafted and st.target_s > 0
            else None,
            prompt_tokens=len(ids),
            cached_tokens=self._cache_hits() - hits_before,
        )
        self.messages.append({"role": "assistant", "content": res.text})
        return res.text

    def room(self, prompt_tokens: int) -> int:
        """How many tokens an answer may have after a prompt of this length: the context's
        positions left, less one round's drafts (the engine's own bound)."""
        limited = self.gen.spec.limited
        if not limited:
            return self.params.max_new_tokens
        return min(m.max_positions for m in limited) - prompt_tokens - self.gen.width - 1

    def _cache_hits(self) -> int:
        cache = getattr(self.gen, "prefix_cache", None)
        return cache.stats.hit if cache is not None else 0

    def command(self, line: str) -> bool:
        """Run a slash command; False when the session should end."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        say = self.console.print
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            say(HELP)
        elif name == "/reset":
            self.messages.clear()
            say("conversation cleared")
        elif name == "/system":
            self.system = arg or None
            self.messages.clear()
            say("system message " + (f"set: {arg}" if arg else "removed") + "; conversation cleared")
        elif name == "/temperature":
            try:
                t = float(arg)
                self.params = replace(self.params, temperature=t)
            except (ValueError, SpecDecodeError) as e:
                say(f"/temperature needs a number >= 0 (0 = greedy): {e}")
            else:
                say(f"temperature {t}")
        elif name == "/stats":
            if self.last is None:
                say("no answer yet")
            else:
                for line_ in self.last.lines():
                    say(line_)
        else:
            say(f"unknown command {name}; /help lists them")
        return True


def run_chat(session: ChatSession, read: Callable[[str], str] = input) -> int:
    """The read-answer loop: a line is a message or a /command; Ctrl-C at the prompt clears the
    line, Ctrl-D (end of input) or /exit leaves."""
    console = session.console
    while True:
        try:
            line = read("> ")
        except KeyboardInterrupt:
            console.print()
            continue
        except EOFError:
            console.print()
            return 0
        if not line.strip():
            continue
        if line.startswith("/"):
            if not session.command(line):
                return 0
            continue
        session.answer(line)
