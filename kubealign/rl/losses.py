"""Policy losses (PPO, Schulman et al. 2017; GSPO, CISPO, SAPO: ppo.policy_loss), the value loss and
diagnostics. Shapes: [B, A] over actions; see kubealign.rl."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from kubealign.rl.advantages import masked_mean, masked_var


class PolicyLoss(NamedTuple):
    loss: torch.Tensor  # scalar
    clip_fraction: torch.Tensor  # scalar: share of response actions where the clipped term was active
    approx_kl: torch.Tensor  # scalar: k3 estimate of KL(old || new), mean over response actions


class ValueLoss(NamedTuple):
    loss: torch.Tensor  # scalar
    clip_fraction: torch.Tensor  # scalar


class Sampling(NamedTuple):
    """The sampling settings of a rollout. top_k / top_p shape only what the rollout draws; the log-probs,
    ratios, KL estimates and entropies take the temperature alone (scaled_logits)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables

    @classmethod
    def of(cls, section: Any) -> Sampling:
        """The settings a config section samples with (ppo's rollout, evaluate's answers: any section with
        temperature, top_k and top_p), for the log-probs that must describe what it drew."""
        return cls(section.temperature, section.top_k, section.top_p)


def scaled_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[..., V] logits -> the float32 logits every log-prob, ratio, KL and entropy is taken from: divided
    by the sampling temperature and NOT filtered by top-k / top-p, as TRL, OpenRLHF and veRL take them.

    Why unfiltered: the filter recomputed from a full forward does not reproduce the one the KV-cached
    rollout applied once precision is bf16/fp16 (a token at the filter's edge falls outside it: measured
    2 of 4,123 sampled tokens at top_p 0.9), and such a token's filtered log-prob is -inf, which makes the
    KL, the whitened advantages and then the whole batch NaN. Unfiltered log-probs are finite for every
    token; old and new log-probs still come from this one function, so the ratio is exactly 1 before the
    first step, and the KL of a model to itself exactly 0. The cost is the peers' too: with a filter the
    ratio's denominator is the unfiltered probability, not the sampler's (docs/ppo.md)."""
    scores = logits.float()
    if sampling.temperature != 1.0:  # x / 1 == x: no pass over [N, T, V] (and none in autograd) for nothing
        scores = scores / sampling.temperature
    return scores


def logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, T, V] logits and [B, T] ids -> [B, T-1] log-probability of each next token (the actions).
    Pass scaled_logits(...) for the log-probs at the sampling temperature."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """[B, T, V] -> [B, T-1] entropy of the next-token distribution at each action (tokens at -inf
    contribute 0 and no NaN gradient)."""
    return entropy_from_logprobs(F.log_softmax(logits[:, :-1].float(), dim=-1))


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """[..., V] normalized log-probs -> [...] entropy, -sum p log p (tokens at -inf contribute 0)."""
    return -(logp.exp() * logp.masked_fill(torch.isinf(logp), 0.0)).sum(-1)


def logprobs_and_entropy(
    logits: torch.Tensor, input_ids: torch.Tensor, entropy_grad: bool, where: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_from_logits, entropy_from_logits) of [B, T, V] logits from ONE log-softmax over the
    vocabulary. entropy_grad False: the entropy is for logging only (entropy_coef 0), computed without
    autograd — the backward pass holds and differentiates nothing the loss does not use — and only at
    the [B, T-1] actions `where` marks, 0 elsewhere (with entropy_grad: at every action)."""
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    logprobs = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    if entropy_grad:
        return logprobs, entropy_from_logprobs(logp)
    with torch.no_grad():
        entropy = torch.zeros_like(logprobs)
        entropy[where.bool()] = entropy_from_logprobs(logp.detach()[where.bool()])
        return logprobs, entropy


def loss_denominator(response_mask: torch.Tensor, how: str = "token", max_tokens: int = 0) -> float:
    """What `aggregate` divides this minibatch's summed loss by (ppo.loss_aggregation), [B, A] mask:
    token     the response tokens;
    sequence  the responses (rows with at least one response token);
    constant  the rows times max_tokens (Dr. GRPO's fixed length), a row with an empty response included."""
    if how == "token":
        return float(response_mask.sum())
    if how == "sequence":
        return float((response_mask.sum(-1) > 0).sum())
    if how == "constant":
        return float(response_mask.shape[0] * max_tokens)
    raise ValueError(f"unknown loss aggregation {how!r} (expected token, sequence or constant)")


def aggregate(
    per_token: torch.Tensor,
    response_mask: torch.Tensor,
    how: str = "token",
    max_tokens: int = 0,
    denominator: float | None = None,
) -> torch.Tensor:
    """[B, A] per-token loss -> scalar, over the response actions (ppo.loss_aggregation):
    token     sum over every response token / their count (DAPO, TRL's "dapo"): each token weighs the
              same, so a long response weighs more;
    sequence  sum over responses of each response's token mean / their count (DeepSeekMath eq. 3, PPO in
              DeepSpeed-Chat's per-sequence form): each response weighs the same;
    constant  sum over every response token / (rows * max_tokens) (Dr. GRPO, Liu et al. 2025, sec. 3.1):
              no length normalization at all, so no bias towards long wrong or short right answers.
    denominator: the count to divide by (loss_denominator's); None: this minibatch's own. The trainer passes
    the count over every rank's minibatch divided by the number of ranks, so that DeepSpeed's mean of the
    ranks' gradients is the gradient of the sum over every rank's tokens / the global count (DAPO's global
    token mean, not the mean of per-rank means). Rows left out of the loss (drop_equal_reward_groups) are
    not passed at all: they are in no denominator."""
    if denominator is None:
        denominator = loss_denominator(response_mask, how, max_tokens)
    mask = response_mask.to(per_token.dtype)
    if how == "sequence":
        rows = mask.sum(-1)
        total = ((per_token * mask).sum(-1) / rows.clamp(min=1)).sum()  # a row without response tokens adds 0
    elif how in ("token", "constant"):
        total = (per_token * mask).sum()
    else:
        raise ValueError(f"unknown loss aggregation {how!r} (expected token, sequence or constant)")
    return total / (denominator if denominator > 0 else 1.0)  # nothing counted: a zero loss, not 0 / 0


class PolicyLossSettings(NamedTuple):
    """What the policy loss reads from ppo's config, built once per run (PolicyLossSettings.of) and passed down
    to policy_loss and every surrogate, so that the loss's signature does not grow with each new choice."""

    kind: str = "ppo"  # ppo.policy_loss: the surrogate's name in SURROGATES
    cliprange: float = 0.2  # eps_low: the ratio's lower bound is 1 - cliprange
    cliprange_high: float | None = None  # eps_high: the upper bound is 1 + cliprange_high; None: cliprange
    aggregation: str = "token"  # ppo.loss_aggregation (aggregate)
    max_tokens: int = 0  # ppo.max_new_tokens: the constant aggregation's length
    sapo_temperature_pos: float = 1.0  # sapo's gate temperature where the advantage is > 0
    sapo_temperature_neg: float = 1.05  # and where it is <= 0

    @classmethod
    def of(cls, cfg: Any) -> PolicyLossSettings:
        """The settings of a ppo config section (PPOConfig)."""
        return cls(
            cfg.policy_loss,
            cfg.cliprange,
            cfg.cliprange_high,
            cfg.loss_aggregation,
            cfg.max_new_tokens,
            cfg.sapo_temperature_pos,
            cfg.sapo_temperature_neg,
        )

    @property
    def clip_high(self) -> float:
        """eps_high as the bounds use it: cliprange_high, or cliprange when that is None (symmetric clip)."""
        return self.cliprange if self.cliprange_high is None else self.cliprange_high


class Surrogate(NamedTuple):
    per_token: torch.Tensor  # [B, A] the loss of each action before aggregation (outside the response: ignored)
    clipped: torch.Tensor  # [B, A] bool: where the bound cut the ratio (or its weight) of this action


def ppo_clip(log_ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float) -> Surrogate:
    """[B, A] -> max(-A r, -A clip(r, 1 - low, 1 + high)), r = exp(log_ratio) (PPO eq. 7 as a loss; high > low
    is DAPO's clip-higher, Yu et al. 2025 eq. 10). The clipped side has no gradient: a token whose ratio has
    left the trust region in the direction its advantage pushes stops moving."""
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    return Surrogate(torch.maximum(unclipped, clipped), clipped > unclipped)


def clipped_surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, settings: PolicyLossSettings
) -> Surrogate:
    """ppo: `ppo_clip` of each token's own ratio to [1 - cliprange, 1 + clip_high] (response_mask: unused)."""
    return ppo_clip(log_ratio, advantages, settings.cliprange, settings.clip_high)


def sequence_log_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, A] token log-ratios -> [B, 1] their mean over each row's response actions: the log of GSPO's
    sequence ratio s_i = (pi(y_i) / pi_old(y_i)) ^ (1 / |y_i|) (Zheng et al. 2025 eq. 7); 0 for an empty row."""
    mask = response_mask.to(log_ratio.dtype)
    return (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)


def gspo_surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, settings: PolicyLossSettings
) -> Surrogate:
    """GSPO-token (Zheng et al. 2025 eq. 13-14): every action of row i carries the sequence ratio s_i in value,
    r_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)], clipped as PPO clips. Why: one ratio per response (a geometric mean)
    is not the noise of single tokens' ratios, which a long answer or an MoE routing change makes large; a row
    is kept or clipped as a whole. With one advantage per row (grpo, rloo) its gradient is GSPO's,
    s_i * A_i * mean_t grad log pi(y_t) per row; with GAE's per-token advantages (ppo) each token keeps its own."""
    seq = sequence_log_ratio(log_ratio, response_mask).detach()
    return ppo_clip(seq + log_ratio - log_ratio.detach(), advantages, settings.cliprange, settings.clip_high)


def cispo_surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, settings: PolicyLossSettings
) -> Surrogate:
    """CISPO (MiniMax-M1, Chen et al. 2025 eq. 4): -sg[clip(r, 1 - low, 1 + high)] * A * log pi per action. The
    importance weight is clipped and held constant, not the update: every token keeps a gradient,
    sg[w] * A * grad log pi, where PPO's clip gives a token out of range none (the rare "fork" tokens a
    reasoning model needs to learn are exactly those). Written as -A * sg[w] * exp(log r - sg[log r]): the
    same gradient, and a value -A * w comparable with the other choices' (TRL's -A w log pi is not).
    MiniMax-M1 bounds only the top: cliprange 1 puts the lower bound at 0, which no ratio reaches."""
    low, high = settings.cliprange, settings.clip_high
    ratio = log_ratio.exp()
    weight = ratio.clamp(1.0 - low, 1.0 + high).detach()
    per_token = -advantages * weight * (log_ratio - log_ratio.detach()).exp()
    return Surrogate(per_token, (ratio < 1.0 - low) | (ratio > 1.0 + high))


def sapo_surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, settings: PolicyLossSettings
) -> Surrogate:
    """SAPO's soft gate (Gao et al. 2025, as TRL implements it): -A * sigmoid(tau (r - 1)) * 4 / tau per action,
    tau = sapo_temperature_pos where A > 0, sapo_temperature_neg elsewhere. Why: a hard clip drops a token's
    gradient at a cliff; the gate's gradient weight 4 sigmoid'(tau (r - 1)) is 1 at r = 1 (the plain policy
    gradient) and fades smoothly as r leaves 1, faster for negative advantages (tau_neg > tau_pos: pushing a
    token's probability down is the less stable direction). Its value at r = 1 is -2 A / tau, not -A. The gate
    has no bound: `clipped` marks where PPO's hard clip would have cut (the same bounds), so that
    clip_fraction compares across the choices."""
    ratio = log_ratio.exp()
    tau = torch.where(advantages > 0, settings.sapo_temperature_pos, settings.sapo_temperature_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    would_clip = ppo_clip(log_ratio.detach(), advantages, settings.cliprange, settings.clip_high).clipped
    return Surrogate(-advantages * gate, would_clip)


# ppo.policy_loss -> how the ratio of the new to the old policy weighs each response action's advantage; one
# signature, (log_ratio, advantages, response_mask, settings) -> Surrogate, chosen by the config's name (as
# veRL registers its policy losses). The names are config/ppo.py's ppo.policy_loss values.
SURROGATES = {
    "ppo": clipped_surrogate,
    "gspo": gspo_surrogate,
    "cispo": cispo_surrogate,
    "sapo": sapo_surrogate,
}
POLICY_LOSSES = tuple(SURROGATES)


def surrogate(
    log_ratio: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor, settings: PolicyLossSettings
) -> Surrogate:
    """[B, A] -> the per-token loss of the surrogate settings.kind names (SURROGATES)."""
    chosen = SURROGATES.get(settings.kind)
    if chosen is None:
        raise ValueError(f"unknown policy loss {settings.kind!r} (expected one of {', '.join(POLICY_LOSSES)})")
    return chosen(log_ratio, advantages, response_mask, settings)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    settings: PolicyLossSettings,
    *,
    denominator: float | None = None,
    weights: torch.Tensor | None = None,
) -> PolicyLoss:
    """[B, A] -> the policy loss of settings.kind (`surrogate`; ppo: the clipped surrogate, PPO paper eq. 7) per
    response action, times `weights` ([B, A], the rollout correction's, held constant; None: 1), aggregated by
    settings.aggregation (`aggregate`), r = exp(logprobs - old_logprobs). Positions outside the response do not
    matter, even at -inf. clip_fraction and approx_kl are token means whatever the aggregation. denominator:
    see `aggregate`."""
    log_ratio = torch.where(response_mask.bool(), logprobs - old_logprobs, torch.zeros_like(logprobs))
    term = surrogate(log_ratio, advantages, response_mask, settings)
    per_token = term.per_token if weights is None else term.per_token * weights.detach().to(term.per_token.dtype)
    loss = aggregate(per_token, response_mask, settings.aggregation, settings.max_tokens, denominator)
    clip_fraction = masked_mean(term.clipped.to(logprobs.dtype), response_mask)
    ratio = log_ratio.exp()
    approx_kl = masked_mean((ratio - 1) - log_ratio, response_mask)  # k3: unbiased, always >= 0
    return PolicyLoss(loss, clip_fraction.detach(), approx_kl.detach())


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
) -> ValueLoss:
    """0.5 * mean over response actions of max((V - R)^2, (V_clipped - R)^2), with V_clipped =
    old_V + clip(V - old_V, -eps, eps) (the PPO2 value clipping DeepSpeed-Chat and TRL use)."""
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_error = (values - returns) ** 2
    clipped_error = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped_error, clipped_error), response_mask)
    clip_fraction = masked_mean((clipped_error > unclipped_error).to(values.dtype), response_mask)
    return ValueLoss(loss, clip_fraction.detach())


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over response actions: 1 = perfect critic, 0 = no better than a constant."""
    return 1 - masked_var(returns - values, response_mask) / masked_var(returns, response_mask).clamp(min=1e-8)
