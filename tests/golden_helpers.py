"""Holding a run to the golden outputs of DeepSeek's official code (``tests/data/golden``).

The tiny seed-1 model is chaotic at a few steps. Its CSA indexer picks 16 of up to 150 compressed
entries from near-flat scores (random weights), so a last-bit change upstream flips picks, and the
flips move that step's top-token log-prob by up to 11 nats. Measured on 2026-12-05 with the same reference
code, where only MKL's code path changed (``MKL_CBWR`` = COMPATIBLE, AVX, AVX2 or AVX-512; these differ
in the last bits of BLAS and vector math alone): 9 to 16 of layer 2's 16 picks differ at case 1's
decode steps. 1 to 5 of the 18 steps deviate by more than 0.5 in the top token's log-prob, the rest by
at most 0.5 (median 0.09 to 0.14). On 9 to 12 of the 12 clear-margin steps, the greedy token is
the official one. The official code differs from itself by ~0.4 between its own prefill and decode
paths (the golden file's note), so another machine's run of it has the same chaos.

So a run is held to the bulk of the steps, not to every step. A real defect (a wrong formula, RoPE
or cache position) moves every step. The thresholds leave room for each of the four MKL paths:

* at least 10 steps have a clear official top-1 margin (>= ``CLEAR``), and the run's greedy token is
  the official one on at least two thirds of them;
* the top token's log-prob is within 0.3 of the official one at the median step, and within
  ``NEAR`` on at least two thirds of the steps;
* the run's top 20 share at least 17 tokens with the official top 20 at the median step, where the
  run has full logits.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

CLEAR = 0.5        # an official top-1 margin at or above this is a clear step
NEAR = 0.5         # a step's log-prob deviation at or below this is near the official one


def margin(step: dict) -> float:
    """The official top-1 margin of a golden step (logit of the top token minus the second's)."""
    return step["top20"][0][1] - step["top20"][1][1]


def official_logprob(step: dict) -> float:
    return step["top20"][0][1] - step["logsumexp"]


@dataclass
class GoldenTally:
    """The per-step facts of a run against the golden steps; ``check()`` applies the rules above."""
    dlps: list[float] = field(default_factory=list)
    clear: list[bool] = field(default_factory=list)     # per clear step: the run's token is the official
    overlaps: list[int] = field(default_factory=list)
    where: list[str] = field(default_factory=list)

    def add_logits(self, lg: torch.Tensor, step: dict, where: str = "") -> None:
        """One step with the run's full logits [V] of the step's position."""
        ids = [t for t, _ in step["top20"]]
        self.dlps.append(abs((lg[ids[0]] - torch.logsumexp(lg, 0)).item() - official_logprob(step)))
        self.overlaps.append(len(set(lg.topk(20).indices.tolist()) & set(ids)))
        if margin(step) >= CLEAR:
            self.clear.append(int(lg.argmax()) == step["argmax"])
        self.where.append(where or f"{step['kind']}@{step['start_pos']}")

    def add_token(self, token: int, logprob: float, step: dict, where: str = "") -> None:
        """One step where the run gives its greedy token and that token's log-prob only: the
        log-prob is compared where the token is the official one."""
        if margin(step) >= CLEAR:
            self.clear.append(token == step["argmax"])
        if token == step["argmax"]:
            self.dlps.append(abs(logprob - official_logprob(step)))
        self.where.append(where or f"{step['kind']}@{step['start_pos']}")

    def check(self) -> None:
        summary = (f"clear steps {sum(self.clear)}/{len(self.clear)} official; log-prob deviations "
                   f"{[round(d, 2) for d in self.dlps]}; top-20 overlaps {self.overlaps}; steps {self.where}")
        assert len(self.clear) >= 10, summary
        assert 3 * sum(self.clear) >= 2 * len(self.clear), summary
        assert self.dlps and statistics.median(self.dlps) <= 0.3, summary
        assert 3 * sum(d <= NEAR for d in self.dlps) >= 2 * len(self.dlps), summary
        if self.overlaps:
            assert statistics.median(self.overlaps) >= 17, summary
