"""
Method options at someone else's defaults, one name away: ``--preset kvpress`` on the command lines.

Our defaults follow the papers (and, where a paper is silent, its authors' scripts: ``methods/README.md``
lists every choice). kvpress (NVIDIA's library of KV-cache "presses", version 0.5.5) picked other defaults
for the methods both have, and a number measured with one set is not comparable with one measured with the
other. ``preset_options(spec, "kvpress")`` gives the options that make our policy run kvpress's settings:

* SnapKV: ours window 32, kernel 7, max pooling; kvpress window 64, kernel 5, average pooling.
* ChunkKV: ours chunks of 10, layer reuse 2, an exact budget (the remainder as single tokens), un-pooled
  votes; kvpress chunks of 20, no reuse, whole chunks only, SnapKV's pooled votes.
* CriticalKV: ours alpha 0.25 of the free budget, epsilon 0; kvpress alpha 0.5 of the whole budget (the
  window included), epsilon 1e-4.
* StreamingLLM (4 sinks) and AdaKV (safeguard 0.20): the same.

Methods kvpress does not have (H2O, Scissorhands, KVReviver) keep ours; an option passed explicitly wins.
"""

from __future__ import annotations

from . import method_chain, method_options

PRESETS: dict[str, dict[str, dict]] = {
    "ours": {},
    "kvpress": {
        "snapkv": {"window": 64, "kernel": 5, "pooling": "avg"},
        "chunkkv": {"chunk_size": 20, "reuse": 1, "remainder": "none"},
        "critical_kv": {"alpha": 0.5, "alpha_of": "budget", "epsilon": 1e-4},
        "streaming_llm": {"n_sink": 4},
        "adakv": {"alpha_safeguard": 0.20},
    },
}


def preset_options(spec: str, preset: str) -> dict:
    """The options for ``make_policy(spec, budget, **options)`` that run ``spec`` at ``preset``'s defaults:
    each method of the chain gets its own (``"critical_kv(adakv(snapkv))"`` gets CriticalKV's, AdaKV's and
    SnapKV's). Raises ValueError for an unknown preset."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    chain, accepted = method_chain(spec), set(method_options(spec))
    options: dict = {}
    for name in chain:
        for key, value in PRESETS[preset].get(name, {}).items():
            if key in accepted:
                options.setdefault(key, value)            # the outermost method's value, as make_policy routes
    return options
