"""
Export a nanollm checkpoint, a GGUF file or a fetchable model as a Hugging Face folder:
``python -m nanollm.cli.hf CHECKPOINT OUT`` (e.g. ``python -m nanollm.cli.hf smollm2-135m /tmp/smollm2-hf``).
"""

from __future__ import annotations

import torch

from .. import cli
from ..io.checkpoint import is_checkpoint, is_gguf, load, resolve
from ..io.hf import export_hf, is_hf_folder, is_nanollm_export


def main(argv: list[str] | None = None) -> None:
    ap = cli.ArgumentParser(prog="python -m nanollm.cli.hf",
                            description="Export a nanollm checkpoint (e.g. a bundled one), a GGUF file or a fetchable "
                                        "model as a Hugging Face folder: config.json + model.safetensors + "
                                        "tokenizer.json.")
    ap.add_argument("checkpoint", help="bundled checkpoint name, nanollm checkpoint folder (nanollm_config.json), "
                                       "GGUF file, or a fetched model's name (smollm2-135m)")
    ap.add_argument("out", help="folder to write: a new or empty folder, or an earlier export of this command "
                                "(its files are replaced)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                    help="dtype of the written weights (default %(default)s)")
    args = ap.parse_args(argv)
    with cli.errors(args.debug):
        cli.not_an_input(args.out, [args.checkpoint], "out")       # neither the checkpoint, in it, nor holding it
        cli.output_folder(args.out, "out", may_hold=is_nanollm_export)
        src = resolve(args.checkpoint)
        if not (is_checkpoint(src) or is_gguf(src)):
            cli.fail(f"{args.checkpoint} is not a nanollm checkpoint (no nanollm_config.json) or a GGUF file"
                     + ("; it is already a Hugging Face folder" if is_hf_folder(src) else ""))
        model, tok, _ = load(src)
        export_hf(model, args.out, getattr(torch, args.dtype), tokenizer=tok)
    print(f"wrote {args.out}: load it with transformers' AutoModelForCausalLM.from_pretrained({args.out!r}) "
          "or nanollm.load")


if __name__ == "__main__":
    main()
