"""SpeculativeGenerator, the front: encode, stream, generate; each run is a Generation
(generation.py: prefill, then rounds of propose -> ONE target forward -> verify -> commit ->
emit), reading only the Speculation that speculation.build decided."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..core.config import SpecConfig
from ..core.sampling import SamplingParams
from ..errors import SpecDecodeError
from ..models.base import CausalLM
from .emit import GenerationResult
from .generation import Generation
from .policy import CostModel, LoadAwarePolicy, LoadCosts, OnlineCosts, make_policy
from .prefill import Defer
from .prefix import PrefixCache
from .speculation import Prompt, build, encode, prepare

__all__ = ["SpeculativeGenerator"]


class SpeculativeGenerator:
    """Exact speculative decoding of `target`, drafting with `draft` (or a method): the front
    that encodes prompts and starts runs; how it speculates is decided once, in `spec`
    (speculation.build).

    draft=None and no method: plain autoregressive decoding through the same runtime, the
    baseline every speed-up is measured against. Options (exit_layer, ngram_max, tree, heads,
    confidence_threshold, max_k, cost_model, ...) are SpecConfig's fields; or pass config=.
    """

    def __init__(
        self,
        target: CausalLM,
        draft: CausalLM | None = None,
        k: int = 4,
        method: str | None = None,
        policy: str = "fixed",
        *,
        config: SpecConfig | None = None,
        **options,
    ) -> None:
        if config is None:
            if method is None and draft is not None:
                method = "draft"
            config = SpecConfig(method=method, k=k, policy=policy, **options)
        self.target, self.config = target, config
        self.spec = build(target, draft, config)
        cost = config.cost_model
        self.cost_model: CostModel | None = CostModel.load(cost) if isinstance(cost, (str, Path)) else cost
        load = config.load_costs
        self.load_costs: LoadCosts | OnlineCosts | None = (
            LoadCosts.load(load) if isinstance(load, (str, Path)) else load
        )
        self.prefix_cache: PrefixCache | None = None  # see enable_prefix_cache()

    # what build() decided, by the names users read
    drafter = property(lambda self: self.spec.drafter)
    tree = property(lambda self: self.spec.tree)
    width = property(lambda self: self.spec.width)
    batch_invariant = property(lambda self: self.spec.invariant)
    method = property(lambda self: self.spec.method)
    k = property(lambda self: self.config.k)

    def new_policy(self, run: Generation):
        """A fresh draft-length policy for one run. The optimal policy's cost model is measured
        on the first run's batch (before its first round) and then kept, so later runs choose k
        the same way."""
        if self.drafter is None:
            return make_policy(SpecConfig())  # fixed, never asked: nothing to draft
        if self.config.policy == "optimal" and self.cost_model is None:
            from .calibrate import measure_costs

            self.cost_model = measure_costs(self.spec, run.rows, self.config.k)
        policy = make_policy(self.config, self.cost_model)
        if self.load_costs is not None:
            policy = LoadAwarePolicy(policy, self.load_costs, lambda: run.rows.params)
        return policy

    def measure_load_costs(
        self, batch_sizes: Sequence[int], prompt_tokens: int = 64, rounds: int = 8, progress=None
    ) -> LoadCosts:
        """Round costs at each batch size (calibrate.measure_load_costs); set the result as
        `load_costs` (or pass it as SpecConfig.load_costs) to draft by load."""
        from .calibrate import measure_load_costs

        return measure_load_costs(self.spec, batch_sizes, prompt_tokens, rounds, progress)

    def enable_prefix_cache(self, budget_bytes: int) -> PrefixCache:
        """Reuse the keys and values of earlier requests' prompts (and outputs) in every later run
        of this generator, within `budget_bytes` (prefix.py). Exact only with the batch-invariant
        forward: SpecDecodeError otherwise."""
        from .prefill import prefix_capable

        probe = self.spec.new_cache(1, 1)
        if not prefix_capable(self.spec, probe):
            why = (
                "the batch-invariant forward (a token's keys and values must not depend on the forward "
                "that computed them)"
                if not self.spec.invariant
                else "a plain key-value cache (this target keeps recurrent state)"
            )
            raise SpecDecodeError(f"prefix caching needs {why}")
        self.prefix_cache = PrefixCache(budget_bytes)
        return self.prefix_cache

    def forget(self) -> None:
        """Forget what earlier requests taught the drafter (the suffix and auto methods' cache of
        earlier prompts and answers). Benchmarks call it between timed runs so that no run drafts
        from another run's answer to the same prompt; the output never depends on it (exact either
        way), only the speed."""
        if self.drafter is not None:
            self.drafter.forget()

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids (chat messages through the target's template); SpecDecodeError
        with a one-line reason when it cannot be encoded."""
        return encode(self.target, prompt)

    def check_request(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        """SpecDecodeError when prompt + max_new_tokens (+ one round's drafts) does not fit."""
        self.spec.check_capacity(len(prompt_ids) + max_new_tokens + self.width + 1)

    def stream(
        self,
        prompts: Sequence[Prompt] | Prompt,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        defer: Defer = None,
        first: bool = False,
    ) -> Generation:
        """Start a batch: iterate the returned Generation for one RoundEvent per round (admit
        more rows with its add()), then call its results(). defer: per row, skip the draft
        model's prefill (the row drafts nothing until Generation.warm() feeds it; a server's
        choice under load). first: admissions that would not draft in their first round take
        their first token from the prefill's forward (an event with forward=False; a server's
        time to first token)."""
        ids, plist = prepare(self.target, prompts, params)
        return Generation(
            self.spec,
            ids,
            plist,
            make_policy=self.new_policy,
            prefix=self.prefix_cache,
            defer=defer,
            first=first,
        )

    def generate(
        self,
        prompts: Sequence[Prompt] | Prompt,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (one batch); results in prompt order."""
        return self.stream(prompts, params).results()
