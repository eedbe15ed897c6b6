"""
Rules every figure of the notebooks keeps, checked while the notebook runs: ``test_notebooks.py`` runs this
file's text in the notebook's kernel after its first cell, so every figure drawn afterwards is checked when
it is rendered, and a last cell asserts that no figure broke a rule.

A figure needs a title (its own or a panel's); both axes named somewhere in it (a label, a shared axis's
label, or text tick labels such as category names); a legend when a panel has two or more labelled series;
a colour bar when it shows an image.
"""

from matplotlib.backend_bases import FigureCanvasBase

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
    return [f"figure {name[:50]!r}: {p}" for p in problems]


def _checked_print_figure(self, *args, **kwargs):
    _FIGURE_PROBLEMS.extend(_check_figure(self.figure))
    return _print_figure(self, *args, **kwargs)


FigureCanvasBase.print_figure = _checked_print_figure
