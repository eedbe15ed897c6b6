"""
The figure rules (``figure_rules.py``, run inside every notebook by ``test_notebooks.py``) catch what they
promise: checked here on figures drawn to break one rule each.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RULES: dict = {}
exec((Path(__file__).parent / "figure_rules.py").read_text(), RULES)


def panel(n_series: int):
    fig, ax = plt.subplots()
    for i in range(n_series):
        ax.plot([0, 1, 2], [i, i + 1, i], label=f"series {i}")
    ax.set(title="Lines", xlabel="step", ylabel="value")
    ax.legend()
    return fig


def test_a_panel_of_six_series_is_refused_and_five_pass():
    try:
        assert RULES["_check_figure"](panel(5)) == []
        assert any("6 labelled series" in p for p in RULES["_check_figure"](panel(6)))
        fig = panel(5)
        fig.axes[0].axhline(0.5, label="the paper's level")          # a reference mark is no series
        fig.axes[0].axhspan(0.2, 0.3, label="the paper's band")
        assert RULES["_check_figure"](fig) == []
    finally:
        plt.close("all")


def test_an_accuracy_line_without_an_interval_is_refused():
    fig, ax = plt.subplots()
    ax.plot([0.1, 0.5], [0.2, 0.8], label="snapkv")
    ax.set(title="Accuracy", xlabel="keep ratio", ylabel="accuracy")
    try:
        assert any("without error bars" in p for p in RULES["_check_figure"](fig))
        ax.fill_between([0.1, 0.5], [0.1, 0.7], [0.3, 0.9])
        assert RULES["_check_figure"](fig) == []
    finally:
        plt.close("all")
