"""The kept-positions plot says what its title counts: a mean over the strips when they differ (AdaKV's heads keep
different numbers of entries; lab 01's titles said "128 of 494 positions kept per head" over strips of 69 to 187)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from experiments.evaluation import viz  # noqa: E402


def title_for(monkeypatch, mask: torch.Tensor) -> str:
    monkeypatch.setattr(viz, "kept_mask", lambda cache, n: mask)
    fig, ax = plt.subplots()
    try:
        viz.plot_kept(ax, None, mask.shape[-1], title="m")
        return ax.get_title()
    finally:
        plt.close(fig)


def test_the_title_says_on_average_only_where_the_strips_differ(monkeypatch):
    even = torch.zeros(2, 2, 10, dtype=torch.bool)
    even[..., :4] = True                                            # every strip keeps 4 of 10
    assert title_for(monkeypatch, even) == "m  (4 of 10 positions kept per head)"
    uneven = even.clone()
    uneven[0, 0, 4:8] = True                                        # one strip keeps 8: the mean is 5
    assert title_for(monkeypatch, uneven) == "m  (5 of 10 positions kept per head on average)"
