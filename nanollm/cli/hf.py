"""
Export a nanollm checkpoint as a Hugging Face folder: ``python -m nanollm.cli.hf CHECKPOINT OUT``.
"""

from __future__ import annotations

import os

import torch

from .. import cli
from ..io.checkpoint import is_checkpoint, load, resolve
from ..io.hf import export_hf, is_hf_folder, is_nanollm_export


def main(argv: list[str] | None = None) -> None:
    ap = cli.ArgumentParser(prog="python -m nanollm.cli.hf",
                            description="Export a nanollm checkpoint (e.g. a bundled one) as a Hugging Face "
                                        "folder: config.json + model.safetensors + tokenizer.json.")
    ap.add_argument("checkpoint", help="bundled checkpoint name or nanollm checkpoint folder (nanollm_config.json)")
    ap.add_argument("out", help="folder to write: a new or empty folder, or an earlier export of this command "
                                "(its files are replaced)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="dtype of the written weights (default %(default)s)")
    args = ap.parse_args(argv)
    with cli.errors(args.debug):
        src = resolve(args.checkpoint)
        if not is_checkpoint(src):
            cli.fail(f"{args.checkpoint} is not a nanollm checkpoint (no nanollm_config.json)"
                     + ("; it is already a Hugging Face folder" if is_hf_folder(src) else ""))
        if os.path.exists(args.out) and os.path.samefile(src, args.out):
            cli.fail(f"out {args.out} is the checkpoint itself; give another folder")
        cli.output_folder(args.out, "out", may_hold=is_nanollm_export)
        model, tok, _ = load(src)
        export_hf(model, args.out, getattr(torch, args.dtype), tokenizer=tok)
    print(f"wrote {args.out}: load it with transformers' AutoModelForCausalLM.from_pretrained({args.out!r}) "
          "or nanollm.load")


if __name__ == "__main__":
    main()
