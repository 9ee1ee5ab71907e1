"""PPO math for the RLHF stage: pure functions of tensors (advantages, losses, KL control).

Tensor vocabulary, shared with the PPO stage: logprobs, ref_logprobs, values, rewards, returns,
advantages, response_mask. All are [B, A] over *action positions*: position t scores the token at
sequence position t + 1 (the logits at t predict it), so A = sequence length - 1, and response_mask
marks the actions that produced response tokens (not prompt, not padding).
"""
