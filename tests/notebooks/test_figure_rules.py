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
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0))          # beside the panel, off the data
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


def lines_panel(n_panels: int = 1):
    fig, axes = plt.subplots(1, n_panels, squeeze=False)
    for ax in axes[0]:
        ax.plot([0, 1, 2, 3], [0.0, 1.0, 0.0, 1.0], label="rising")
        ax.plot([0, 1, 2, 3], [0.2, 0.2, 0.2, 0.2], label="flat")
        ax.set(title="Lines", xlabel="step", ylabel="value", ylim=(-0.1, 2.0))
        ax.legend(loc="upper right")                   # the data stays under 1.0 of a y axis up to 2.0
    return fig, axes[0]


def test_a_fifth_panel_is_refused():
    try:
        assert RULES["_check_figure"](lines_panel(4)[0]) == []
        assert any("5 panels" in p for p in RULES["_check_figure"](lines_panel(5)[0]))
    finally:
        plt.close("all")


def test_text_under_nine_points_is_refused_tick_labels_too():
    try:
        fig, (ax,) = lines_panel()
        ax.text(1, 1.5, "a note", fontsize=9)
        assert RULES["_check_figure"](fig) == []
        ax.tick_params(labelsize=8)
        assert any("under 9 points" in p and "pt" in p for p in RULES["_check_figure"](fig))
        fig, (ax,) = lines_panel()
        ax.text(1, 1.5, "a note", fontsize=8.5)
        assert any("'a note' (8.5 pt)" in p for p in RULES["_check_figure"](fig))
    finally:
        plt.close("all")


def test_a_legend_over_the_data_is_refused_and_one_beside_it_passes():
    try:
        fig, (ax,) = lines_panel()
        assert RULES["_check_figure"](fig) == []
        ax.legend(loc="lower left")                    # over the flat line at 0.2
        assert any("legend sits over the data" in p for p in RULES["_check_figure"](fig))
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0))          # outside the panel
        assert RULES["_check_figure"](fig) == []
        ax.plot([0, 3], [0, 2], label="diagonal")     # one segment through the middle, its two points far off
        ax.legend(loc="center")
        assert any("legend sits over the data" in p for p in RULES["_check_figure"](fig))
        fig, (ax,) = lines_panel()
        ax.bar([1.5], [1.9], width=0.2, label="bar")   # a bar reaching under the legend's corner
        ax.legend(loc="upper center")
        assert any("legend sits over the data" in p for p in RULES["_check_figure"](fig))
    finally:
        plt.close("all")
