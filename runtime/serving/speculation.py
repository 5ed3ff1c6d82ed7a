"""Speculative decoding in the serving engine (``tessera serve --speculative ngram``).

Why: a decoding step of a small batch is bound by reading the weights; a step over k + 1 tokens
of a row reads them once too. So when a greedy request's output repeats its context (editing or
quoting a passage, code, extraction), prompt lookup (generation/drafting.py's ``NgramDrafter``)
guesses its next k tokens and one engine step checks them all, emitting up to k + 1 tokens.

How it fits the engine (serving/engine.py): ``Engine._decode_step`` asks ``step(engine)`` first.
When no greedy row has a draft it returns False and the engine's own step runs (one token a row,
the GroupQueryAttention in-place kernel and all). Otherwise this step replaces it: ONE call of the
model over every decoding row, each row's chunk left-aligned in a [n, T] block -- a speculating
row's next token and its drafts, any other row's next token alone (sampled rows decode as usual,
their token chosen by the engine's ``_choose`` from their last column), a row still prefilling
an empty chunk (masked, its outputs dropped). The padding follows a row's tokens, so causality hides
it from them and a row's keys stay its filled columns then its own tokens: the layout the engine's
CUDA variant derives its mask from (compiler/backends/onnx/prefix_mask.py), where no mask is fed
(a mask-less graph's padding is visible to the padding alone). T > 1 runs the graph's prompt branch against the
rows' cache views (as a prompt chunk does), so every position's logits come back; the model is
compiled with them: on the CPU the engine's variant gives every position's logits in calls of at
most drafts + 1 tokens and the last position's in longer ones, so it keeps the combined call
(serving/model.py ``load(check_tokens=...)``); elsewhere every call gives every position's. While a
prompt is being prefilled, an iteration whose rows check no drafts (``plan`` says so) is the engine's
combined call (a prompt chunk and one token a row); one that checks drafts runs the prompt's chunk
alone and then ``run``. Every padded row's last column is unmasked in a checking call: a 0 there
marks a combined call (compiler/backends/onnx/mixed_attention.py ``_marker``), and the padding's
own outputs are dropped.

Each row's new columns are written at its ``filled``; the row keeps its next token and the
longest prefix of drafts equal to the model's greedy choices, plus the model's own choice after
them (the correction, or a bonus when all were right). Rejected columns stay masked (the slot mask
is set for the kept ones only) and the next step overwrites them: a row's columns stay contiguous,
so the engine needs no rollback of its own. Every token is the one plain greedy decoding gives
(the same argmax; the attention kernel differs, as a prompt's last logits differ from a step's, by
rounding). Only greedy requests with nothing else asked of the logits (``Sampling.plain_greedy``:
no repetition penalty, no logprobs, no look-back processors) speculate.

Adaptive (the default, ``adaptive=True``): each step chooses how many tokens to check, 0 (the
engine's plain step) included, from what calls cost on this machine now and what each request's
drafts have been worth. A verifying call of n rows x T positions is priced by ``StepCosts`` -- the
measured seconds of this engine's own calls, an exponential average per size, linear in the
tokens a call runs between sizes measured -- against the plain step of n rows, measured the same
way. Each row's acceptance rate a (accepted / (accepted + rejections), a prior of one each) gives the
tokens it is expected to emit with d drafts, 1 + a + ... + a^d; the step takes the T maximising
expected tokens per second, or the plain step when that is better. Why: a verifying call costs what
its n x T tokens cost; at one stream that is about one weight read (speculation pays), at 16 streams
the products are compute-bound and 16 x 7 tokens cost several plain steps (it loses unless nearly
every draft is accepted). While a kind of call has not been measured yet, it is run (each once
first), and every ``EXPLORE``-th decision takes the other choice (the plain step, or a verifying
call of one draft: the cheapest), so the prices follow the load.
"""

from __future__ import annotations

import time

import numpy as np

from tessera.runtime.options import GenerateOptions

from . import model as serving_model
from tessera.runtime.generation.constraints import masked_argmax

from .model import UsageError


class StepCosts:
    """Measured seconds of one kind of call by its size (rows, or rows x positions): an exponential
    average per size (``DECAY``); between and past the sizes measured, a straight line through the two
    nearest (one size measured: that figure, flat)."""

    DECAY = 0.3  # weight of a new measurement

    def __init__(self):
        self.seconds: dict[int, float] = {}

    def observe(self, size: int, seconds: float) -> None:
        old = self.seconds.get(size)
        self.seconds[size] = seconds if old is None else (1 - self.DECAY) * old + self.DECAY * seconds

    def __bool__(self) -> bool:
        return bool(self.seconds)

    def __call__(self, size: int) -> float:
        if size in self.seconds:
            return self.seconds[size]
        sizes = sorted(self.seconds)
        if len(sizes) == 1:
            return self.seconds[sizes[0]]
        below = [x for x in sizes if x < size][-1:] or sizes[:1]
        above = [x for x in sizes if x > size][:1] or sizes[-1:]
        if below == above:  # past the ends: the two nearest
            pair = sizes[:2] if size < sizes[0] else sizes[-2:]
        else:
            pair = below + above
        (x0, x1), (y0, y1) = pair, (self.seconds[pair[0]], self.seconds[pair[1]])
        return max(y0 + (y1 - y0) * (size - x0) / (x1 - x0), 1e-9)


def expected_tokens(rate: float, drafts: int) -> float:
    """Tokens a row emits from a verifying call with ``drafts`` drafts, each accepted with probability
    ``rate`` until the first rejection: the model's own token, plus rate + rate^2 + ... + rate^drafts."""
    return 1.0 + sum(rate ** j for j in range(1, drafts + 1))


class Speculation:
    """Prompt-lookup drafting and one verifying call per engine step; counts what it drafted."""

    DRAFT_TOKENS = GenerateOptions.NGRAM_DRAFT_TOKENS  # --draft-tokens' default: generate's with prompt lookup
    EXPLORE = 32  # every EXPLORE-th decision takes the other choice, to keep both prices current

    def __init__(self, draft_tokens: int = DRAFT_TOKENS, adaptive: bool = True):
        if not isinstance(draft_tokens, int) or isinstance(draft_tokens, bool) or draft_tokens < 1:
            raise UsageError(f"--draft-tokens must be an integer >= 1, got {draft_tokens}")
        self.k = draft_tokens
        self.adaptive = adaptive
        self.drafter = serving_model.NgramDrafter()
        self.drafted = self.accepted = self.calls = 0
        self.plain_cost, self.verify_cost = StepCosts(), StepCosts()  # by rows; by rows x positions
        self.decisions = 0
        self.declined = 0  # steps with drafts that ran the plain step instead (the cost said so)
        self.rates: dict[int, list[int]] = {}  # handle id -> [accepted, rejections] of its drafts

    @staticmethod
    def check(model, draft_tokens: int = DRAFT_TOKENS) -> None:
        """The model must give the logits of every position of a checking call (``draft_tokens`` + 1 tokens):
        compiled with every position's, or the engine's variant whose short calls give them
        (serving/model.py ``short_call_logits``)."""
        if model.info.last_only and serving_model.short_call_logits(model) < draft_tokens + 1:
            raise UsageError("--speculative needs the logits of every position; this file was compiled with the "
                             "last position's only (--kv-cache does that): serve the .tsr spec or checkpoint folder")

    def attach(self, engine) -> "Speculation":
        """Make this the engine's speculation: its decoding steps ask ``step`` first, its /metrics
        show the counters."""
        engine.speculation = self
        engine.metrics.sections.append(self.metric_lines)
        return self

    def describe(self) -> str:
        how = ("adaptive: each step checks the number of drafts (0: the plain step) that maximises the expected "
               "tokens per second, from this engine's measured call times and each request's acceptance rate"
               if self.adaptive else "every draft checked")
        return (f"speculative decoding: prompt lookup (ngram), up to {self.k} drafted tokens per greedy request "
                f"per step, checked in the step's one call (the model gives every position's logits); {how}")

    def observe_plain(self, rows: int, seconds: float) -> None:
        """The engine's plain decoding step of ``rows`` rows took ``seconds`` (engine._decode_step)."""
        self.plain_cost.observe(rows, seconds)

    def _rate(self, seq) -> float:
        acc, rej = self.rates.get(seq.handle.id, (0, 0))
        return (acc + 1) / (acc + rej + 2)

    def choose(self, n: int, drafts: dict[int, list[int]], rates: dict[int, float]) -> int:
        """How many drafts a row may have this step (0: none, the plain step), for ``n`` rows in the
        call, ``drafts`` by slot and each drafting row's acceptance ``rates``: the most expected tokens
        per second, the plain step's n / plain_cost(n) against each T = k + 1's."""
        longest = max(len(d) for d in drafts.values())
        if not self.adaptive:
            return longest
        self.decisions += 1
        if not self.plain_cost:
            return 0  # measure the plain step first
        if not self.verify_cost:
            return longest
        best, best_rate = 0, n / self.plain_cost(n)
        for k in range(1, longest + 1):
            tokens = n - len(drafts) + sum(expected_tokens(rates[r], min(k, len(d))) for r, d in drafts.items())
            rate = tokens / self.verify_cost(n * (k + 1))
            if rate > best_rate:
                best, best_rate = k, rate
        if self.decisions % self.EXPLORE == 0:  # now and then the other choice, so its price stays current:
            best = 1 if best == 0 else 0  # the cheapest verifying call, or the plain step
        return best

    def metric_lines(self) -> list[str]:
        """Prometheus counters (serving/metrics.py renders them after its own)."""
        out = []
        for name, help_, value in (
                ("tessera_speculative_drafted_tokens_total", "Tokens drafted by prompt lookup.", self.drafted),
                ("tessera_speculative_accepted_tokens_total", "Drafted tokens the model agreed with.", self.accepted),
                ("tessera_speculative_steps_total", "Engine steps that checked drafts.", self.calls),
                ("tessera_speculative_declined_steps_total", "Steps with drafts that ran the plain step: "
                 "checking them was priced slower.", self.declined)):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {value}"]
        return out

    def _drafts(self, engine, decoding) -> dict[int, list[int]]:
        out = {}
        for s in decoding:
            h, req = s.handle, s.handle.request
            if not req.sampling.plain_greedy:
                continue
            # room for the drafts: in the request's budget (the correction or bonus is one more token) and
            # in the slot's columns (the chunk is the next token and the drafts)
            budget = min(self.k, req.max_tokens - len(h.tokens) - 1, engine.capacity - s.filled - 1)
            if budget > 0:
                d = self.drafter.lookup(req.prompt + h.tokens, budget)
                if d and s.mask is not None:  # structured output: drafts past the grammar are rejected unchecked
                    d = d[:s.mask.valid_prefix(d)]
                if d:
                    out[s.slot] = d
        return out

    def step(self, engine) -> bool:
        """The engine's decoding step with drafts checked (see the module docstring); False, having
        run nothing, when no row has a draft or checking them was priced slower."""
        plan = self.plan(engine)
        if plan is None:
            return False
        self.run(engine, plan)
        return True

    def plan(self, engine) -> dict | None:
        """The drafts this step would check, by row (the _Sequence), or None for the plain step: no
        greedy row has a draft, or checking them was priced slower (``choose``)."""
        rows = engine.rows
        decoding = [s for s in rows if not s.prefilling]
        if not decoding:
            return None
        drafts = self._drafts(engine, decoding)
        if not drafts:
            return None
        live = {s.handle.id for s in rows}
        for gone in [i for i in self.rates if i not in live]:
            del self.rates[gone]
        k = self.choose(max(s.slot for s in decoding) + 1, drafts,
                        {s.slot: self._rate(s) for s in decoding if s.slot in drafts})
        if k == 0:
            self.declined += 1
            return None
        by_slot = {s.slot: s for s in decoding}
        return {by_slot[r]: d[:k] for r, d in drafts.items()}

    def run(self, engine, plan: dict) -> None:
        """One checking call over every decoding row, ``plan``'s rows with their drafts (a row of the plan
        that no longer decodes -- finished meanwhile -- is left out; the slots are read now)."""
        info, rows = engine.info, engine.rows
        decoding = [s for s in rows if not s.prefilling]
        if not decoding:
            return
        drafts = {s.slot: d for s, d in plan.items() if s in decoding}
        chunks = {s.slot: [s.next_token] + drafts.get(s.slot, []) for s in decoding}
        n = max(chunks) + 1
        t = max(len(c) for c in chunks.values())
        engine._fit(max(s.filled + len(chunks[s.slot]) for s in decoding))
        width = engine.width
        views = engine._views() if engine.device_cache is None else None  # the numpy cache's, else on the device
        tokens = np.zeros((n, t), dtype=np.int64)
        new = np.zeros((n, t), dtype=np.int64)
        positions = np.zeros((n, t), dtype=np.int64)
        for s in rows[:n]:
            c = chunks.get(s.slot, [])
            m = len(c)
            positions[s.slot] = max(s.filled - 1, 0)  # padding (after the tokens): any position; masked or later
            if m:
                tokens[s.slot, :m] = c
                new[s.slot, :m] = 1
                positions[s.slot, :m] = s.filled + np.arange(m)
        feeds = {info.tokens: tokens, "position_ids": positions,
                 **({name: v[:n] for name, v in views.items()} if views is not None else {})}
        if engine.feeds_mask:  # else derived in the graph (the rows' filled columns and every new one)
            mask = np.concatenate([engine.slots[:n, :width], new], axis=1)
            mask[:, -1] = 1  # not a combined call (whose marker is a 0 there); a padded row's last column is its own
            feeds["attention_mask"] = mask
        if info.length_input:  # read by the one-token branch only; T > 1 takes the prompt branch
            feeds[info.length_input] = np.array([s.filled for s in rows[:n]], dtype=np.int64)
        if engine.decode_mask:  # CUDA's decoding-branch input; T > 1 takes the prompt branch, which ignores it
            feeds["decode_mask"] = np.ones((n, 1), dtype=np.int64)
        if engine.decode_span:  # the same without the mask's values (the engine's variant)
            feeds["decode_span"] = np.zeros((0, 1), dtype=np.int64)
        started = time.perf_counter()
        # the device cache binds the rows' views from its buffers; every position's logits come back
        out = engine.model.run(feeds) if views is not None else engine._run_chunk(feeds, 0, n)
        self.verify_cost.observe(n * t, time.perf_counter() - started)
        engine.steps += 1
        self.calls += 1
        logits = out[info.logits]
        finished = []
        for s in decoding:
            c, r = chunks[s.slot], s.slot
            m, f = len(c), s.filled
            # every new column at the row's end; only the kept ones are unmasked
            engine._put(r, f, out, r, 0, m, views)
            if r not in drafts:  # one token, as the engine's own step chooses it
                tok = engine._choose(s, logits[r:r + 1, m - 1])
                kept, emitted = 1, [tok]
            else:
                d, emitted, kept, mask = drafts[r], [], 1, s.mask
                for j in range(m):  # position j's logits choose the token after chunk[j]
                    if mask is None:
                        tok = int(np.argmax(logits[r, j]))
                    else:  # the greedy choice among the tokens the grammar allows after the drafts so far
                        tok = masked_argmax(logits[r, j], mask.allowed())
                    emitted.append(tok)
                    if j == m - 1 or tok != d[j]:
                        break
                    kept += 1
                    if mask is not None:
                        mask.consume(d[j])
                if mask is not None:  # back to the row's state: _emit advances it over the emitted tokens
                    mask.rollback(kept - 1)
                self.drafted += len(d)
            engine.slots[r, f:f + kept] = 1
            s.filled += kept
            done = 0
            for tok in emitted:
                s.next_token = tok
                engine._emit(s, tok)
                done += 1
                if s.handle.finished:
                    break
            if r in drafts:
                self.accepted += min(kept - 1, done)
                rate = self.rates.setdefault(s.handle.id, [0, 0])
                rate[0] += kept - 1
                rate[1] += kept - 1 < len(drafts[r])  # a rejection ended the run
            if s.handle.finished:
                finished.append(s)
        for s in sorted(finished, key=lambda s: -s.slot):
            engine._release(s)
