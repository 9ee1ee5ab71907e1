"""MLflow tracking: where a stage's run goes and its lifecycle (runs: stage_run, the URI and experiment
resolution) and the trackers it logs through (trackers: NullTracker, MlflowTracker, BackgroundTracker)."""
