"""The feedback stage's picture across rounds: of the tasks pushed from what each round's canary served, people's
weighted win-rate of that round's challenger and each automatic judge's agreement with people on that round's
pairs alone, with its Wilson 95 % interval: rounds.png and rounds.md in the stage's output, logged to its MLflow
run and shown in the KFP UI (the feedback task's HTML artifact).

The figures are the pull's metrics (kubealign.feedback.pull.served_figures): human_win_rate_weighted_round_N and
round_N/agreement_<judge>, _low, _high, _n. `across_rounds` reads them back (pure); `write` draws them.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

WIN_RATE = re.compile(r"human_win_rate_weighted_round_(\d+)")
AGREEMENT = re.compile(r"round_(\d+)/agreement_(\w+?)(_low|_high|_n)?")


def across_rounds(metrics: dict[str, float]) -> dict[int, dict[str, Any]]:
    """{round: {"win_rate": the challenger's weighted win-rate or None, "judges": {judge: {rate, low, high, n}}}},
    in round order; {} when no task pushed from what was served was decided."""
    table: dict[int, dict[str, Any]] = {}
    for key, value in metrics.items():
        if found := WIN_RATE.fullmatch(key):
            table.setdefault(int(found[1]), {"win_rate": None, "judges": {}})["win_rate"] = value
        elif found := AGREEMENT.fullmatch(key):
            row = table.setdefault(int(found[1]), {"win_rate": None, "judges": {}})
            field = (found[3] or "_rate")[1:]
            row["judges"].setdefault(found[2], {})[field] = value
    return dict(sorted(table.items()))


def markdown(table: dict[int, dict[str, Any]]) -> str:
    """rounds.md: one row per round, one column per judge (agreement, its interval and the tasks it leaned on)."""
    judges = sorted({j for row in table.values() for j in row["judges"]})
    out = [
        "# People across rounds",
        "",
        "| round | people's weighted win-rate of the challenger | " + " | ".join(f"{j} agrees" for j in judges) + " |",
        "|---" * (2 + len(judges)) + "|",
    ]
    for number, row in table.items():
        cells = [f"{row['win_rate']:.2f}" if row["win_rate"] is not None else "n/a"]
        for judge in judges:
            a = row["judges"].get(judge)
            shown = a and not math.isnan(a["rate"])  # NaN: the judge leaned on none of the round's decided pairs
            cells.append(f"{a['rate']:.2f} ({a['low']:.2f}-{a['high']:.2f}, n={a['n']:.0f})" if shown else "n/a")
        out.append(f"| {number} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def write(table: dict[int, dict[str, Any]], directory: Path) -> list[Path]:
    """rounds.png (both figures across rounds, the judges' intervals as bars) and rounds.md in `directory`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = list(table)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    rates = [(n, row["win_rate"]) for n, row in table.items() if row["win_rate"] is not None]
    left.plot([n for n, _ in rates], [r for _, r in rates], "-o", color="tab:blue")
    left.axhline(0.5, color="grey", lw=0.8)
    left.set(title="people's win-rate of each round's challenger", xlabel="round", ylabel="weighted win-rate")
    for judge in sorted({j for row in table.values() for j in row["judges"]}):
        shown = [(n, row["judges"][judge]) for n, row in table.items() if row["judges"].get(judge, {}).get("n")]
        xs, ys = [n for n, _ in shown], [a["rate"] for _, a in shown]
        bars = [[a["rate"] - a["low"] for _, a in shown], [a["high"] - a["rate"] for _, a in shown]]
        right.errorbar(xs, ys, yerr=bars, fmt="-o", capsize=3, label=judge)
    right.set(title="each judge's agreement with people (95 %)", xlabel="round", ylabel="agreement")
    for axis in (left, right):
        axis.set_ylim(0, 1)
        axis.set_xticks(rounds)
    if right.get_legend_handles_labels()[0]:
        right.legend()
    fig.tight_layout()
    png, md = directory / "rounds.png", directory / "rounds.md"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    md.write_text(markdown(table), encoding="utf-8")
    return [png, md]
