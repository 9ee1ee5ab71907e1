"""The synthetic task's grade of answers: on the built-in synthetic data the generator's grammar
(kubealign.data.synthetic.grade) says of every answer whether it is well formed, on topic and preferred
(courteous and on topic): the demo's ground truth, which evaluate reports beside the scores. On other data
there is no grammar and nothing is graded.
"""

from __future__ import annotations

from typing import Any

from kubealign.config import KubealignConfig


def graded(config: KubealignConfig, table: list[dict[str, Any]]) -> dict[str, float]:
    """The share of each model's answers in `table` (evaluate's rows: "prompt", "baseline", "candidate" texts)
    that is well formed, on topic and preferred, as <model>_<field>_rate; nothing unless every data source is
    the synthetic one."""
    if not table or any(s.path != "synthetic" for s in config.data.sources):
        return {}
    from kubealign.data import synthetic

    metrics = {}
    for name in ("baseline", "candidate"):
        grades = [synthetic.grade(row["prompt"], row[name]) for row in table]
        for field in ("well_formed", "on_topic", "preferred"):
            metrics[f"{name}_{field}_rate"] = sum(getattr(g, field) for g in grades) / len(grades)
    return metrics
