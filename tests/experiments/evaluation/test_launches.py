"""``experiments.evaluation.launches.Counter``: what counts as a launch, a view, an allocation and a host wait."""

import torch

from experiments.evaluation.launches import Counter


def test_counter_sorts_operations_into_launches_views_allocations_and_waits():
    x = torch.arange(6.0)
    with Counter() as c:
        y = x.view(2, 3)              # a view: no kernel
        z = torch.empty(3)            # an allocation: no kernel
        z.copy_(y[0])                 # a launch (the slice before it is a view)
        w = (y + 1).sum()             # two launches
        int(w)                        # a launch the host waits for
    assert sum(c.counts.values()) == 4
    assert c.views == 2 and c.allocations == 1
    assert sum(c.waits.values()) == 1


def test_a_deep_copy_is_one_launch_per_tensor():
    """copy.deepcopy of a tensor allocates and swaps storages, then copies once: one launch."""
    import copy
    x = torch.randn(3, 4)
    with Counter() as c:
        copy.deepcopy(x)
    assert sum(c.counts.values()) == 1 and c.allocations >= 1
