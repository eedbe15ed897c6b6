"""
Generation with a KV-cache method: ``python -m experiments.evaluation.generate --method snapkv --budget 64``.

The same command line as ``python -m nanollm.cli.generate`` (see ``--help``), plus ``--method`` and
``--budget``: nanollm does not import the methods, so this module hands it ``make_policy``.
"""

from __future__ import annotations

from methods import make_policy
from nanollm.cli.generate import main as _main


def main(argv: list[str] | None = None) -> None:
    _main(argv, make_policy=make_policy, prog="python -m experiments.evaluation.generate")


if __name__ == "__main__":
    main()
