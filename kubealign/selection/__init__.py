"""The selection rules, pure functions of data: the candidates of a run (candidates), the paired comparison
of two policies' scored responses (comparison), the reward-KL frontier (frontier) and the ranking rule of
several routes' evaluations (ranking)."""
