"""The selection rules, pure functions of data: the paired comparison of two policies' scored responses
(comparison), the reward-KL frontier (frontier) and the ranking rule of several routes' evaluations (ranking).
The candidates themselves are configuration (kubealign.config.candidates)."""
