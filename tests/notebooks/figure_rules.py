"""
Rules every figure of the notebooks keeps, checked while the notebook runs: ``test_notebooks.py`` runs this
file's text in the notebook's kernel after its first cell, so every figure drawn afterwards is checked when
it is rendered, and a last cell asserts that no figure broke a rule.

A figure needs a title (its own or a panel's); both axes named somewhere in it (a label, a shared axis's
label, or text tick labels such as category names); a legend when a panel has two or more labelled series;
a colour bar when it shows an image; titles and axis labels in words, not code names (no ``snake_case``);
error bars (or a shaded band) on every line or bar of accuracy, which always has an interval here (Wilson's
or the bootstrap's); log axes whose tick labels a reader can read (at least two labelled major ticks in
view, or a formatter of the notebook's own, instead of matplotlib's "6x10^0" minor labels alone); and at
most five labelled data series in a panel (more are small multiples: one panel per group; a reference
line or band does not count); at most four panels a figure (more are two figures); no text under 9 points
(tick labels, legends, titles, notes); and no legend inside a panel over its data (a line, a marker, a bar or
a filled band under the legend's box: put it where the data is not, or outside the panel).
"""

import re

import numpy as np
from matplotlib.backend_bases import FigureCanvasBase
from matplotlib.collections import PathCollection
from matplotlib.container import BarContainer, ErrorbarContainer
from matplotlib.lines import Line2D
from matplotlib.text import Text
from matplotlib.ticker import LogFormatter

_FIGURE_PROBLEMS = []
_print_figure = FigureCanvasBase.print_figure


def _named(ax, axis):
    """An axis is described by its label, a sibling's (shared axes), or text tick labels (categories)."""
    get = "get_xlabel" if axis == "x" else "get_ylabel"
    shared = ax.get_shared_x_axes() if axis == "x" else ax.get_shared_y_axes()
    if any(getattr(a, get)() for a in shared.get_siblings(ax)):
        return True
    ticks = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()
    return any(t.get_text() and not t.get_text().replace("−", "-").replace(".", "").lstrip("-").isdigit()
               for t in ticks)


_SNAKE = re.compile(r"\b[a-z][a-z0-9]*_[a-z0-9_]+\b")


def _texts(fig, axes):
    """(what, text) for the figure's title and every panel's title and axis labels."""
    out = [("title", fig._suptitle.get_text())] if fig._suptitle is not None else []
    for ax in axes:
        out += [("title", ax.get_title()), ("x label", ax.get_xlabel()), ("y label", ax.get_ylabel())]
    return [(what, t) for what, t in out if t]


def _has_interval(ax):
    """Error bars or a shaded band (``fill_between``) on the panel."""
    return any(isinstance(c, ErrorbarContainer) for c in ax.containers) or \
        any(type(c).__name__ in ("PolyCollection", "FillBetweenPolyCollection") for c in ax.collections)


def _plots_accuracy(ax):
    """A panel whose y axis is accuracy, drawn as lines or bars (not an image)."""
    bars = any(isinstance(c, BarContainer) for c in ax.containers)
    return "accuracy" in ax.get_ylabel().lower() and (bars or any(ln.get_label() != "_nolegend_" and
                                                                      len(ln.get_xdata()) > 1 for ln in ax.lines))


def _log_ticks_readable(ax, axis):
    """A log axis with two or more labelled major ticks in view, or a formatter the notebook chose."""
    obj = ax.xaxis if axis == "x" else ax.yaxis
    if obj.get_scale() != "log" or not isinstance(obj.get_major_formatter(), LogFormatter):
        return True
    lo, hi = sorted(ax.get_xlim() if axis == "x" else ax.get_ylim())
    return sum(lo <= t <= hi for t in obj.get_majorticklocs()) >= 2


MAX_SERIES = 5


def _series(ax):
    """The labelled data series of a panel: lines of three or more points, bar groups, error bars and
    scatters; reference marks (a horizontal or vertical line, a shaded span) do not count."""
    handles, labels = ax.get_legend_handles_labels()
    def data(h):
        if isinstance(h, Line2D):
            return len(h.get_xdata()) > 2
        return isinstance(h, (BarContainer, ErrorbarContainer, PathCollection))
    return len({label for h, label in zip(handles, labels) if not label.startswith("_") and data(h)})


MAX_PANELS = 4
MIN_POINTS = 9


def _small_texts(fig):
    """The visible texts of the figure set under ``MIN_POINTS`` points (tick labels included)."""
    return sorted({(t.get_text().strip()[:20], round(t.get_fontsize(), 1)) for t in fig.findobj(Text)
                   if t.get_visible() and t.get_text().strip() and t.get_fontsize() < MIN_POINTS - 1e-6})


def _line_points(ax):
    """The points of the panel's lines and markers in display coordinates, 16 on every segment of a drawn line
    (so a legend over a straight stretch is caught). Reference lines drawn across the panel (``axhline``: not
    in data coordinates) are left out."""
    out = [np.zeros((0, 2))]
    for line in ax.lines:
        if not line.get_visible() or line.get_transform() != ax.transData:
            continue
        xy = ax.transData.transform(np.asarray(line.get_xydata(), float))   # units (categories) converted
        xy = xy[np.isfinite(xy).all(axis=1)]
        if len(xy) > 1 and line.get_linestyle() not in ("None", "none", " ", ""):
            t = np.linspace(0, 1, 16)[:, None, None]
            xy = (xy[:-1] * (1 - t) + xy[1:] * t).reshape(-1, 2)
        out.append(xy)
    for c in ax.collections:
        if c.get_visible() and isinstance(c, PathCollection) and len(c.get_offsets()):
            out.append(c.get_offset_transform().transform(np.asarray(c.get_offsets(), float)))
    return np.concatenate(out)


def _legend_over_data(ax):
    """Whether the panel's own legend box covers its data: a point of a line or a marker, a bar, or a shaded
    band in data coordinates (a figure legend is outside the panels; a reference span is not data)."""
    legend = ax.get_legend()
    if legend is None or not legend.get_visible() or ax.images:
        return False
    box = legend.get_window_extent()
    xy = _line_points(ax)
    if ((xy[:, 0] > box.x0) & (xy[:, 0] < box.x1) & (xy[:, 1] > box.y0) & (xy[:, 1] < box.y1)).any():
        return True
    if any(patch.get_visible() and type(patch).__name__ == "Rectangle" and patch.get_data_transform() == ax.transData
           and box.overlaps(patch.get_window_extent()) for patch in ax.patches):                      # bars
        return True
    corners = np.array([[box.x0, box.y0], [box.x1, box.y0], [box.x0, box.y1], [box.x1, box.y1],
                        [(box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2]])
    for c in ax.collections:                                                                          # bands
        if c.get_visible() and type(c).__name__ in ("PolyCollection", "FillBetweenPolyCollection") \
                and c.get_transform() == ax.transData:
            for path in c.get_paths():
                shape = path.transformed(ax.transData)
                inside = (shape.vertices[:, 0] > box.x0) & (shape.vertices[:, 0] < box.x1) & \
                    (shape.vertices[:, 1] > box.y0) & (shape.vertices[:, 1] < box.y1)
                if inside.any() or shape.contains_points(corners).any():
                    return True
    return False


def _check_figure(fig):
    """Figure-level rules: a title; every axis named somewhere (a label, or text tick labels); a legend when
    some panel has two or more labelled series; a colour bar when there are images."""
    axes = [ax for ax in fig.axes if ax.get_label() != "<colorbar>" and ax.axison
            and (ax.lines or ax.images or ax.collections or ax.patches)]
    if not axes:
        return []
    name = fig._suptitle.get_text() if fig._suptitle is not None else (axes[0].get_title() or "untitled")
    problems = []
    if not (fig._suptitle is not None and fig._suptitle.get_text()) and not any(ax.get_title() for ax in axes):
        problems.append("no title")
    for axis in "xy":
        if not any(_named(ax, axis) for ax in axes):
            problems.append(f"no {axis} label")
    if any(len([t for t in ax.get_legend_handles_labels()[1] if not t.startswith("_")]) >= 2 for ax in axes) \
            and not fig.legends and not any(ax.get_legend() is not None for ax in fig.axes):
        problems.append("labelled series and no legend")
    images = [im for ax in axes for im in ax.images] + [c for ax in axes for c in ax.collections
                                                          if type(c).__name__ == "QuadMesh"]
    if images and not any(a.get_label() == "<colorbar>" for a in fig.axes) \
            and not any(getattr(im, "colorbar", None) is not None for im in images):
        problems.append("images and no colour bar")
    problems += [f"{what} {text!r} is a code name: write it in words" for what, text in _texts(fig, axes)
                 if _SNAKE.search(text)]
    problems += [f"panel {ax.get_title()[:40]!r} plots accuracy without error bars or a band"
                 for ax in axes if _plots_accuracy(ax) and not _has_interval(ax)]
    problems += [f"panel {ax.get_title()[:40]!r} has {n} labelled series: at most {MAX_SERIES} a panel, draw "
                 "small multiples" for ax in axes if (n := _series(ax)) > MAX_SERIES]
    if len(axes) > MAX_PANELS:
        problems.append(f"{len(axes)} panels: at most {MAX_PANELS} a figure, draw two figures")
    fig.draw_without_rendering()               # lay out the figure: its ticks, the legends' boxes, the data's places
    if small := _small_texts(fig):
        problems.append(f"{len(small)} texts under {MIN_POINTS} points, such as "
                        + ", ".join(f"{text!r} ({size} pt)" for text, size in small[:3]))
    problems += [f"panel {ax.get_title()[:40]!r}: its legend sits over the data; place it where the data is "
                     "not, or outside the panel" for ax in axes if _legend_over_data(ax)]
    problems += [f"panel {ax.get_title()[:40]!r}: its log {a} axis shows fewer than two labelled major ticks; "
                 "widen the limits or set a formatter" for ax in axes for a in "xy" if not _log_ticks_readable(ax, a)]
    return [f"figure {name[:50]!r}: {p}" for p in problems]


def _checked_print_figure(self, *args, **kwargs):
    _FIGURE_PROBLEMS.extend(_check_figure(self.figure))
    return _print_figure(self, *args, **kwargs)


FigureCanvasBase.print_figure = _checked_print_figure
