"""The GRPO demo's pieces: the task (reverse a short digit string), a tiny GRU policy, and the GRPO update.

The task has a checkable answer, so the reward needs no model: a prompt is 2-4 digits (`DIGITS` symbols), the
response should be the same digits reversed, and the reward is the share of positions right (0.2 for a uniformly
random policy with 5 digits, 1.0 when solved).

Token layout of one row: `prompt` (the digits), then `SEP`, then the `response` (as long as the prompt). The policy
reads `prompt + [SEP] + response[:-1]` and its outputs from the `SEP` position on score the response tokens.

The update is GRPO (Shao et al. 2024): the advantage of a completion is its reward minus the mean reward of its
group (all completions of one prompt), divided by the group's standard deviation; the loss is PPO's clipped ratio
loss per token against the log-probs the rollout worker recorded, plus `kl_coef` times the k3 estimate of
KL(policy || reference) per token, averaged over each completion's tokens and then over the batch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import require

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import Tensor

DIGITS = 5            # digits 0..DIGITS-1
SEP = DIGITS          # separates prompt and response
VOCAB = DIGITS + 1


@dataclasses.dataclass
class GRPOConfig:
    """Hyperparameters of the demo (defaults learn visibly on a shared 2-core CPU in a minute or two)."""

    group: int = 8              # completions per prompt (G)
    prompts_per_step: int = 8   # groups per trainer step
    min_len: int = 2            # prompt (and response) lengths, inclusive
    max_len: int = 4
    hidden: int = 64
    embed: int = 32
    lr: float = 3e-3
    clip: float = 0.2
    kl_coef: float = 0.02
    max_staleness: int = 2      # policy versions a consumed row may lag behind the trainer's


# ---------------------------------------------------------------------------------------------------------- task
def make_prompts(rng: np.random.Generator, n: int, length: int) -> np.ndarray:
    """`n` prompts of `length` digits, int64 [n, length]."""
    return rng.integers(0, DIGITS, size=(n, length), dtype=np.int64)


def reward(prompt: np.ndarray, response: np.ndarray) -> float:
    """Share of response positions equal to the reversed prompt (0..1); a wrong length scores 0."""
    prompt, response = np.asarray(prompt), np.asarray(response)
    if response.shape != prompt.shape or prompt.size == 0:
        return 0.0
    return float(np.mean(response == prompt[::-1]))


def rewards(prompts: list[np.ndarray], responses: list[np.ndarray]) -> np.ndarray:
    """`reward` of each (prompt, response) pair, float32."""
    return np.array([reward(p, r) for p, r in zip(prompts, responses)], dtype=np.float32)


# ---------------------------------------------------------------------------------------------------------- policy
def make_policy(cfg: GRPOConfig, seed: int = 0) -> torch.nn.Module:
    """A GRU language model over the task's vocabulary (a `torch.nn.Module`)."""
    torch = require("torch", "demo")
    nn = torch.nn
    torch.manual_seed(seed)

    class Policy(nn.Module):  # type: ignore[name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, cfg.embed)
            self.gru = nn.GRU(cfg.embed, cfg.hidden, batch_first=True)
            self.head = nn.Linear(cfg.hidden, VOCAB)

        def forward(self, tokens: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
            out, state = self.gru(self.embed(tokens), state)
            return self.head(out), state

    return Policy()


def generate(policy: torch.nn.Module, prompts: np.ndarray, group: int,
             generator: torch.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Sample `group` completions of each prompt (rows repeat each prompt `group` times, prompt-major).

    Returns (responses int32 [P*G, L], log-probs float32 [P*G, L]) under `policy` at temperature 1; the
    response is as long as its prompt (all prompts of one call have the same length L).
    """
    torch = require("torch", "demo")
    p = torch.as_tensor(np.repeat(prompts, group, axis=0))
    n, length = p.shape
    toks, lps = [], []
    with torch.no_grad():
        logits, state = policy(torch.cat([p, torch.full((n, 1), SEP, dtype=torch.long)], 1))
        last = logits[:, -1]
        for _ in range(length):
            logp = torch.log_softmax(last, -1)
            tok = torch.multinomial(logp.exp(), 1, generator=generator)
            toks.append(tok)
            lps.append(logp.gather(1, tok))
            logits, state = policy(tok, state)
            last = logits[:, -1]
    return (torch.cat(toks, 1).numpy().astype(np.int32), torch.cat(lps, 1).numpy().astype(np.float32))


def token_logprobs(policy: torch.nn.Module, prompts: list[np.ndarray],
                   responses: list[np.ndarray]) -> list[torch.Tensor]:
    """Log-probs (torch, with grad) of each response's tokens under `policy`, one 1-D tensor per row.

    Rows are batched by length (one forward pass per distinct prompt length), no padding.
    """
    torch = require("torch", "demo")
    out: list[Any] = [None] * len(prompts)
    lengths = np.array([len(p) for p in prompts])
    for length in np.unique(lengths).tolist():
        rows = np.flatnonzero(lengths == length)
        p = torch.as_tensor(np.stack([prompts[i] for i in rows]).astype(np.int64))
        r = torch.as_tensor(np.stack([responses[i] for i in rows]).astype(np.int64))
        x = torch.cat([p, torch.full((len(rows), 1), SEP, dtype=torch.long), r[:, :-1]], 1)
        logits, _ = policy(x)
        logp = torch.log_softmax(logits[:, length:], -1).gather(2, r.unsqueeze(2)).squeeze(2)
        for k, i in enumerate(rows.tolist()):
            out[i] = logp[k]
    return out


# ---------------------------------------------------------------------------------------------------------- update
def group_advantages(rewards: np.ndarray, groups: np.ndarray, eps: float = 1e-4) -> np.ndarray:
    """(reward - group mean) / (group std + eps) per row, float32 (vectorised over groups)."""
    r = np.asarray(rewards, dtype=np.float64)
    _, inv = np.unique(np.asarray(groups), return_inverse=True)
    count = np.bincount(inv).astype(np.float64)
    mean = np.bincount(inv, weights=r) / count
    var = np.bincount(inv, weights=r * r) / count - mean ** 2
    std = np.sqrt(np.maximum(var, 0.0))
    return ((r - mean[inv]) / (std[inv] + eps)).astype(np.float32)


def grpo_loss(new_logps: list[torch.Tensor], old_logps: list[np.ndarray], ref_logps: list[np.ndarray],
              advantages: np.ndarray, clip: float, kl_coef: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO loss over a batch (see the module docstring) and a few diagnostics."""
    torch = require("torch", "demo")
    new = torch.cat(new_logps)
    old = torch.as_tensor(np.concatenate(old_logps).astype(np.float32))
    ref = torch.as_tensor(np.concatenate(ref_logps).astype(np.float32))
    lens = torch.as_tensor([len(x) for x in old_logps])
    adv = torch.repeat_interleave(torch.as_tensor(advantages), lens)
    ratio = torch.exp(new - old)
    pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    d = ref - new
    kl = torch.exp(d) - d - 1  # k3: unbiased, non-negative
    per_token = pg + kl_coef * kl
    row = torch.repeat_interleave(torch.arange(len(lens)), lens)
    per_row = torch.zeros(len(lens)).index_add(0, row, per_token) / lens
    loss = per_row.mean()
    return loss, {"kl": float(kl.detach().mean()),
                  "clipped": float(((ratio.detach() - 1).abs() > clip).float().mean())}


class GRPOTrainer:
    """The policy being trained, its optimiser and the version counter."""

    def __init__(self, cfg: GRPOConfig, seed: int = 0) -> None:
        self.torch = require("torch", "demo")
        self.cfg = cfg
        self.policy = make_policy(cfg, seed)
        self.opt = self.torch.optim.Adam(self.policy.parameters(), lr=cfg.lr)
        self.version = 0

    def step(self, prompts: list[np.ndarray], responses: list[np.ndarray], old_logps: list[np.ndarray],
             ref_logps: list[np.ndarray], rewards: np.ndarray, groups: np.ndarray) -> dict[str, float]:
        """One gradient step on whole groups; bumps `version`."""
        adv = group_advantages(rewards, groups)
        new = token_logprobs(self.policy, prompts, responses)
        loss, info = grpo_loss(new, old_logps, ref_logps, adv, self.cfg.clip, self.cfg.kl_coef)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.policy.parameters(), 1.0)
        self.opt.step()
        self.version += 1
        return {"loss": float(loss.detach()), **info}


__all__ = ["DIGITS", "SEP", "VOCAB", "GRPOConfig", "GRPOTrainer", "generate", "grpo_loss", "group_advantages",
           "make_policy", "make_prompts", "reward", "rewards", "token_logprobs"]
