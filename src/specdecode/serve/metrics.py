"""Prometheus metrics (prometheus-client), under vLLM's names where vLLM has one, with our
`specdecode:` prefix instead of `vllm:` (counters get prometheus-client's `_total` suffix)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()  # no `_created` series beside each counter

P = "specdecode:"
LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class Metrics:
    """One registry per server, so several servers in one process (tests) do not collide."""

    def __init__(self, max_positions: int = 32) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge(
            P + "num_requests_running", "Requests with rows in the running batch", registry=r
        )
        self.waiting = Gauge(P + "num_requests_waiting", "Requests waiting for room in the batch", registry=r)
        self.running_rows = Gauge(P + "running_batch_size", "Rows (choices) in the running batch", registry=r)
        self.draft_cap = Gauge(
            P + "draft_length_cap",
            "The load-aware policy's draft-length cap last round (-1: none)",
            registry=r,
        )
        self.draft_cap.set(-1)
        self.requests = Counter(
            P + "request_success", "Finished requests by finish reason", ["finished_reason"], registry=r
        )
        self.rejected = Counter(
            P + "request_rejected", "Requests refused before admission", ["reason"], registry=r
        )
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", registry=r)
        self.rounds = Counter(P + "engine_rounds", "Rounds (target forwards) run", registry=r)
        self.num_drafts = Counter(P + "spec_decode_num_drafts", "Row-rounds that drafted", registry=r)
        self.num_draft_tokens = Counter(
            P + "spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r
        )
        self.num_accepted = Counter(
            P + "spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r
        )
        self.accepted_per_pos = Counter(
            P + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0-based)",
            ["position"],
            registry=r,
        )
        self.ttft = Histogram(
            P + "time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY, registry=r
        )
        self.tpot = Histogram(
            P + "time_per_output_token_seconds",
            "Mean time per token after the first",
            buckets=PER_TOKEN,
            registry=r,
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds", "Arrival to last token", buckets=LATENCY, registry=r
        )

        self.prefix_queries = Counter(
            P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            P + "prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r
        )
        self.prefix_bytes = Gauge(P + "prefix_cache_bytes", "Bytes held by the prefix cache", registry=r)
        self.prefill_tokens = Counter(
            P + "prefill_tokens", "Prompt tokens prefilled (not taken from the prefix cache)", registry=r
        )
        self.carried_tokens = Counter(
            P + "prefill_carried_tokens",
            "Prompt tokens prefilled inside the running rows' round (one pass over the weights for both)",
            registry=r,
        )
        self.deferred_rows = Counter(
            P + "draft_deferred_rows",
            "Rows admitted without the draft model's prefill (drafting did not pay at that load)",
            registry=r,
        )
        self.warmed_rows = Counter(
            P + "draft_warmed_rows", "Deferred rows whose draft model was fed later, to draft", registry=r
        )
        self.draft_prefill_tokens = Counter(
            P + "draft_prefill_tokens", "Prompt tokens fed to the draft model (its own prefill)", registry=r
        )
        self.draft_prefill_seconds = Counter(
            P + "draft_prefill_seconds", "Seconds spent feeding the draft model its prompts", registry=r
        )
        self.round_cost = Gauge(
            P + "round_cost_correction",
            "Learned round cost / start-up table, for rounds that draft (1: as measured at start)",
            registry=r,
        )
        self.round_cost.set(1.0)

    def round(
        self, drafted: list[int], accepted: list[int], emitted: int, cap: int | None, forward: bool = True
    ) -> None:
        """One round's counts; forward=False: first tokens from the prefill (not a round)."""
        self.rounds.inc(forward)
        self.generation_tokens.inc(emitted)
        self.num_drafts.inc(sum(1 for d in drafted if d))
        self.num_draft_tokens.inc(sum(drafted))
        self.num_accepted.inc(sum(accepted))
        for a in accepted:
            for j in range(a):
                self.accepted_per_pos.labels(str(j)).inc()
        if cap is not None:
            self.draft_cap.set(cap)

    def request_done(self, reason: str) -> None:
        self.requests.labels(reason).inc()
