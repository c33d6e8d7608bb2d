"""Probe (temporary): replay prompt lookup's drafting under the draft gate with a GPU-like clock.

Greedy continuations of the speculation figure's prompts come from the real SmolLM2 on this CPU
(`--make`); the replay then runs the batch's drafting logic itself (`BatchDrafts`, `RowSpeculation`,
`PromptLookup`, `DraftGate`) without a model: a draft is kept as far as it matches the greedy
continuation, and each step advances a fake clock by a cost model fitted to the H200 figure at
`3c401a3` (plain and verify steps' milliseconds by batch size). It shows, turn by turn as the figure
runs them, what the gate drafts against forced drafting, and the time each would take.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mlxq.worker.engine.batch_drafts import BatchDrafts
from mlxq.worker.engine.speculation.draft_gate import DraftGate
from mlxq.worker.engine.speculation.policy import DraftPolicy, RowSpeculation
from mlxq.worker.engine.speculation.prompt_lookup import PromptLookup

OUT = Path("/tmp/gate_replay.json")
TOKENS = 128


def make() -> None:
    from mlxq.jobs.schema import GenerateRequest
    from mlxq.worker.engine import Engine
    from mlxq.worker.engine.generation_batch import GenerationBatch
    from mlxq.worker.modelfiles.default_model import default_model_dir

    from .fig_speculation import KINDS

    engine = Engine.load(str(default_model_dir()))
    bias = {i: -100.0 for i in engine.tokenizer.eos_ids}
    out: dict[str, list[dict[str, list[int]]]] = {}
    for kind, prompts in KINDS.items():
        batch = GenerationBatch(engine, len(prompts))
        reqs = []
        for i, p in enumerate(prompts):
            req = GenerateRequest(
                messages=[{"role": "user", "content": p}], max_tokens=TOKENS, temperature=0, logit_bias=bias
            )
            reqs.append(engine.prepare_generation(req)[0])
            batch.admit(str(i), req, lambda _t, _ids: None, lambda: False)
        res: dict[str, list[int]] = {}
        while len(batch):
            for done in batch.step():
                assert done.result is not None
                res[done.key] = list(done.result.token_ids)
        out[kind] = [{"prompt": list(reqs[i]), "tokens": res[str(i)]} for i in range(len(prompts))]
    OUT.write_text(json.dumps(out))


class Clock:
    def __init__(self, noise: float = 0.0, spikes: float = 0.0, seed: int = 0) -> None:
        import random

        self.t = 0.0
        self.noise, self.spikes, self.rng = noise, spikes, random.Random(seed)

    def add(self, ms: float) -> None:
        """Advance by a step of `ms`, with the host's noise: lognormal, and now and then 3x."""
        factor = self.rng.lognormvariate(0.0, self.noise) if self.noise else 1.0
        if self.spikes and self.rng.random() < self.spikes:
            factor *= 3.0
        self.t += ms * factor / 1e3

    def __call__(self) -> float:
        return self.t


@dataclass
class Run:
    ids: list[int] = field(default_factory=list)


@dataclass
class Row:
    prompt: list[int]
    cont: list[int]
    speculation: RowSpeculation | None
    run: Run = field(default_factory=Run)
    depth: int = 0
    proposed: int = 0
    ahead: int = 0

    @property
    def budget(self) -> int:
        return TOKENS - len(self.run.ids) - 1

    @property
    def pending(self) -> int:
        return self.cont[len(self.run.ids)]


# H200 step costs (ms) at `3c401a3`, SmolLM2: plain steps by rows; a verify step's fixed part and per
# token fed; the plain step after a verify step reads its tokens back (nothing was in flight)
PLAIN = {1: 6.1, 2: 6.5, 4: 7.5, 8: 8.7}
VERIFY = {1: (10.0, 0.15), 2: (12.0, 0.1), 4: (14.0, 0.07), 8: (17.0, 0.04)}
READ = 2.0


def cls(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def replay(engine: Any, seqs: list[dict[str, list[int]]], n: int, clock: Clock) -> dict[str, float]:
    """The sequences `n` at a time; the simulated seconds, tokens, drafted and kept."""
    tokens = drafted = kept = 0
    t0 = clock.t
    gate = engine.draft_gate
    verify_steps = plain_steps = 0
    for first in range(0, len(seqs), n):
        rows = [
            Row(
                s["prompt"],
                s["tokens"],
                RowSpeculation(
                    PromptLookup(), engine.policy, max(engine.policy.max_depth, engine.policy.max_run)
                )
                if engine.options.speculation != "off"
                else None,
            )
            for s in seqs[first : first + n]
        ]
        drafts = BatchDrafts(engine)
        last_verify = False
        while rows:
            m = len(rows)
            if gate is not None:
                gate.begin(m)
            verify = drafts.speculating(rows)
            drafts.progress = 0
            proposals = drafts.propose(rows, [r.pending for r in rows]) if verify else [[] for _ in rows]
            if verify and any(proposals):
                fed = sum(1 + max(len(p) for p in proposals) for _ in rows)
                base, per = VERIFY[cls(m)]
                clock.add(base + per * fed)
                gains = []
                for r, p in zip(rows, proposals, strict=True):
                    at = len(r.run.ids) + 1
                    k = 0
                    while k < len(p) and at + k < len(r.cont) and p[k] == r.cont[at + k]:
                        k += 1
                    k = min(k, TOKENS - at)
                    if r.depth > 0 and r.speculation is not None:
                        r.speculation.observe(r.proposed, k)
                        drafted += r.proposed
                        kept += k
                    r.run.ids.extend(r.cont[len(r.run.ids) : at + k])
                    gains.append(1 + k)
                drafts.count_progress(rows, gains)
                kind = "verify"
                verify_steps += 1
                last_verify = True
            else:
                clock.add(PLAIN[cls(m)] + (READ if last_verify else 0.0))
                for r in rows:
                    r.run.ids.append(r.pending)
                drafts.count_progress(rows, [1] * m)
                kind = "plain"
                plain_steps += 1
                last_verify = False
            if gate is not None:
                gate.end(kind, drafts.progress)
            done = [r for r in rows if len(r.run.ids) >= TOKENS]
            tokens += sum(TOKENS for _ in done)
            rows = [r for r in rows if len(r.run.ids) < TOKENS]
    secs = clock.t - t0
    return {
        "tok_s": tokens / secs,
        "drafted": drafted,
        "kept": kept,
        "verify_steps": verify_steps,
        "plain_steps": plain_steps,
    }


def engine(kind: str, policy: DraftPolicy, clock: Clock) -> Any:
    gate = DraftGate(clock=clock) if kind != "off" and policy.gate else None
    return SimpleNamespace(options=SimpleNamespace(speculation=kind), draft_gate=gate, policy=policy)


def main() -> None:
    from mlxq.worker.service import draft_policy
    from mlxq.worker.settings import WorkerSettings

    data = json.loads(OUT.read_text())
    noise = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    spikes = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    clock = Clock(noise, spikes, int(sys.argv[5]) if len(sys.argv) > 5 else 0)
    default = draft_policy(WorkerSettings())
    modes = {
        "plain": engine("off", default, clock),
        "lookup": engine("prompt_lookup", default, clock),
        "forced": engine("prompt_lookup", DraftPolicy(max_batch=1 << 20), clock),
    }
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    for kind in ("copy-heavy", "prose"):
        for n in (1, 8):
            seqs = [data[kind][i % 3] for i in range(max(n, 3))]
            per: dict[str, list[str]] = {m: [] for m in modes}
            for turn in range(reps + 1):
                names = list(modes)
                order = names[turn % 3 :] + names[: turn % 3]
                res = {name: replay(modes[name], seqs, n, clock) for name in order}
                for name in names:
                    r = res[name]
                    ratio = r["tok_s"] / res["plain"]["tok_s"]
                    per[name].append(f"{ratio:.2f}({r['drafted']}/{r['kept']},v{r['verify_steps']})")
            ratios = sorted(float(c.split("(")[0]) for c in per["lookup"][1:])
            print(f"== {kind}, {n} jobs: lookup median {ratios[len(ratios) // 2]:.2f}")
            for name, cells in per.items():
                print(f"  {name:7s} {' '.join(cells)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make"]:
        make()
    else:
        main()
