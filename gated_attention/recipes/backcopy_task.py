"""The Bigram-Backcopy task (Guo et al. 2024, arXiv 2410.13835), its query split and its attention metrics.

Every sequence starts with BOS. Token ids: 0 = BOS, `1 .. n_tokens` the ordinary
tokens, `n_tokens + 1 .. n_tokens + n_triggers` the triggers. The ordinary tokens
follow a fixed sparse bigram chain: each has `successors` likely next tokens
(Dirichlet weights, the chain drawn from the seed). After an ordinary token the
next one is a trigger with probability `trigger_prob` (uniform over triggers),
else the chain's successor; after a trigger the next token copies the token
before the trigger. The first token after BOS is an ordinary token (uniform),
so a trigger always has an ordinary token before it, and triggers never follow
each other.

Index conventions (tested on a hand-made sequence in `tests/test_backcopy.py`): a
query is the position t whose output predicts x[t+1]. Query t (t >= 1) is
*active* when x[t] is a trigger (its prediction is the copy of x[t-1], which
needs attention) and *dormant* otherwise (its prediction is the bigram of x[t],
which needs none). Query 0 (BOS) is neither: it can attend only to itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

BOS = 0


@dataclass(frozen=True)
class BackcopyTask:
    """The chain (drawn from `seed`) and how sequences are sampled from it."""

    n_tokens: int = 64  # ordinary tokens
    n_triggers: int = 3
    successors: int = 4  # likely next tokens of each ordinary token
    trigger_prob: float = 0.1
    seed: int = 0

    # the model config reads the vocabulary like a tokenizer's
    bos_token_id: int = BOS
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __len__(self) -> int:
        return 1 + self.n_tokens + self.n_triggers

    @property
    def triggers(self) -> range:
        return range(1 + self.n_tokens, len(self))

    def transition(self) -> np.ndarray:
        """The bigram chain over ordinary tokens: `[n_tokens, n_tokens]`, rows sum to 1, `successors` non-zeros each."""
        rng = np.random.default_rng([self.seed, 51])
        p = np.zeros((self.n_tokens, self.n_tokens))
        for i in range(self.n_tokens):
            nxt = rng.choice(self.n_tokens, size=min(self.successors, self.n_tokens), replace=False)
            p[i, nxt] = rng.dirichlet(np.ones(len(nxt)))
        return p

    def sample(self, n: int, seq_len: int, seed: int) -> torch.Tensor:
        """`n` sequences of `seq_len` tokens, BOS first: `[n, seq_len]` int64, a pure function of (task, n, seq_len, seed)."""
        rng = np.random.default_rng([self.seed, seed, 7])
        cum = np.cumsum(self.transition(), axis=1)  # [n_tokens, n_tokens]
        x = np.zeros((n, seq_len), dtype=np.int64)
        if seq_len < 2:
            return torch.from_numpy(x)
        x[:, 1] = 1 + rng.integers(0, self.n_tokens, n)
        for t in range(2, seq_len):
            prev = x[:, t - 1]
            is_trigger = prev > self.n_tokens
            u = rng.random(n)
            nxt = 1 + np.minimum((u[:, None] > cum[np.clip(prev, 1, self.n_tokens) - 1]).sum(axis=1), self.n_tokens - 1)
            trig = rng.random(n) < self.trigger_prob
            nxt = np.where(trig, 1 + self.n_tokens + rng.integers(0, self.n_triggers, n), nxt)
            x[:, t] = np.where(is_trigger, x[:, t - 2], nxt)
        return torch.from_numpy(x)

    def query_kinds(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Boolean masks `(dormant, active)` of the queries of `x` `[..., T]` (see the module's index conventions)."""
        is_trigger = x > self.n_tokens
        past_bos = torch.ones_like(is_trigger)
        past_bos[..., 0] = False
        return past_bos & ~is_trigger, past_bos & is_trigger

    def optimal_loss(self, rows: torch.Tensor) -> float:
        """The Bayes-optimal mean loss (nats) over every predicted token of `rows` `[N, T]` (queries 0 .. T-2, as
        `training.evaluate_loss` counts them): the entropy of each query's next token given its past, which is
        log(n_tokens) at BOS, 0 after a trigger (the copy), and otherwise the trigger choice plus the bigram's entropy."""
        p = self.transition()
        h_row = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), axis=1)  # [n_tokens]
        q = self.trigger_prob
        h_choice = -(q * math.log(q / self.n_triggers) if q > 0 else 0) - ((1 - q) * math.log(1 - q) if q < 1 else 0)
        x = rows[:, :-1].numpy()
        h = np.where(x > self.n_tokens, 0.0, h_choice + (1 - q) * h_row[np.clip(x, 1, self.n_tokens) - 1])
        h[:, 0] = math.log(self.n_tokens)  # BOS: the first token is uniform over the ordinary ones
        return float(h.mean())


# ---------------------------------------------------------------------------------------------
# Measurement


@torch.no_grad()
def attention_by_query(model, task: BackcopyTask, rows: torch.Tensor) -> dict:
    """Per attention layer (1-based), attention on the first token at dormant and at active queries, mean over
    heads and queries of `rows` `[N, T]`; and the residual statistics.

    Returns `{"layers": [{layer, f_attn_dormant, f_attn_active, f_attn_all, first_token_norm_ratio, sink_dormant}...],
    "m_act",
    "gate_mean", "maps": {layer: [H, T, T] of rows[0]}}`: M-Act is the mean over decoder layers l = 1..L of the
    largest |X[l]|, mean over sequences; a layer's `first_token_norm_ratio` is the first token's max |X[l]| over the
    largest of the other tokens', in that layer's output, mean over sequences. `sink_dormant` is the attention a
    learned sink (`attention_sinks`) takes at dormant queries, what the tokens' weights leave of 1 (NaN without).
    """
    from ..analysis.capture import Capture

    model.eval()
    device = next(model.parameters()).device
    sums: dict[int, np.ndarray] = {}  # layer -> [3]: dormant, active, all (sums of per-query means over heads)
    sink_sums: dict[int, float] = {}  # layer -> the learned sink's share at dormant queries, summed
    sinks = getattr(model.config, "attention_sinks", False)
    counts = np.zeros(3)
    m_act, ratio, gates, maps = [], [], [], {}
    with Capture(model, residual=True, attentions=True, gates=True) as cap:
        for i, x in enumerate(rows):
            cap.clear()
            model(input_ids=x[None].to(device), use_cache=False)
            record = cap.records[-1]
            dormant, active = task.query_kinds(x)
            everyone = dormant | active
            masks = [m.numpy() for m in (dormant, active, everyone)]
            counts += [m.sum() for m in masks]
            for f in cap.layout.attention_layers:
                a = record.attentions[f][0].float().cpu().numpy()  # [H, T, T]
                on_first = a[:, :, 0].mean(axis=0)  # [T]: per query, mean over heads
                sums[f] = sums.get(f, np.zeros(3)) + [on_first[m].sum() for m in masks]
                sink_sums[f] = sink_sums.get(f, 0.0) + float((1 - a.sum(axis=-1).mean(axis=0))[masks[0]].sum())
                if i == 0:
                    maps[f] = a
            token_max = record.residual_stack()[:, 0].abs().amax(dim=-1).float().cpu().numpy()[1:]  # [L, T]: X[1..L]
            m_act.append(token_max.max(axis=1).mean())
            ratio.append(token_max[:, 0] / token_max[:, 1:].max(axis=1))  # [L]
            gates += [g.float().cpu().numpy().ravel() for g in record.gates.values()]
    ratio = np.mean(ratio, axis=0)  # [L]
    layers = [{"layer": f, "f_attn_dormant": s[0] / max(counts[0], 1), "f_attn_active": s[1] / counts[1] if counts[1]
               else math.nan, "f_attn_all": s[2] / max(counts[2], 1), "first_token_norm_ratio": float(ratio[f - 1]),
               "sink_dormant": sink_sums[f] / max(counts[0], 1) if sinks else math.nan}
              for f, s in sorted(sums.items())]
    return {
        "layers": layers, "m_act": float(np.mean(m_act)),
        "gate_mean": float(np.concatenate(gates).mean()) if gates else math.nan, "maps": maps,
    }
