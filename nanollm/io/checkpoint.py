"""
Checkpoint folders: save, load, and the bundled models.

A nanollm checkpoint is a folder::

    nanollm_config.json   the ModelConfig fields
    model.safetensors     the weights (a tied lm_head is not stored twice)
    tokenizer.json        the BPE ranks and split pattern (nanollm.io.tokenizer.Tokenizer)
    card.json             the model card: how it was trained, and its measured accuracy
    README.md             the same card, for people

``load(name_or_path)`` takes the name of a bundled checkpoint (a folder under ``nanollm/checkpoints/``),
the path of a checkpoint folder, the path of a local Hugging Face-format folder (``config.json`` +
weights, see ``hf.py``), the path of a GGUF file (``gguf.py``), or the name of a pretrained model fetched
once into a cache folder (``smollm2-135m``: ``python -m nanollm.cli.fetch smollm2-135m``, see ``fetch.py``;
nothing is downloaded at run time), and returns ``(model, tokenizer, card)``. ``load_config``, ``load_tokenizer`` and
``load_card`` read one part without the weights (what the command lines check their arguments against).

Every file is written atomically (``files.atomic_open``): a failed save leaves the previous file, never half
of one.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import ModelConfig
from ..model import Transformer
from . import fetch, safetensors
from .files import atomic_write_text
from .tokenizer import Tokenizer

BUNDLED_DIR = Path(__file__).parent.parent / "checkpoints"      # nanollm/checkpoints/


def bundled() -> list[str]:
    """Names of the checkpoints shipped with the package."""
    return sorted(p.name for p in BUNDLED_DIR.iterdir() if (p / "nanollm_config.json").exists()) \
        if BUNDLED_DIR.exists() else []


def is_gguf(path: str | Path) -> bool:
    """True for a file named ``*.gguf`` (what ``load`` reads with ``gguf.py``)."""
    return Path(path).suffix == ".gguf" and Path(path).is_file()


def resolve(name_or_path: str | Path) -> Path:
    """The folder or GGUF file behind a bundled checkpoint name, a fetched model's name (``fetch.py``; one
    not fetched yet is an error that says how) or a path; a clear error when it is none of them."""
    p = Path(name_or_path)
    if p.is_dir() or is_gguf(p):
        return p
    if (BUNDLED_DIR / str(name_or_path)).is_dir():
        return BUNDLED_DIR / str(name_or_path)
    if str(name_or_path) in fetch.REMOTES:       # never downloads: an error says how to fetch it
        return fetch.model_file(str(name_or_path), download=False)
    raise ValueError(f"no checkpoint {str(name_or_path)!r}: not a folder or .gguf file, not a bundled checkpoint "
                     f"(bundled: {bundled()}) and not a fetchable model ({sorted(fetch.REMOTES)})")


def save(model: Transformer, tok: Tokenizer | None, folder: str | Path, card: dict | None = None) -> None:
    """Write a checkpoint folder; ``tok=None`` for a model whose tokens are not text (no tokenizer.json:
    load it with ``load_model``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / "nanollm_config.json", json.dumps(model.config.to_dict(), indent=1))
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        state.pop("lm_head.weight")
    safetensors.save_file(state, folder / "model.safetensors", metadata={"format": "pt", "source": "nanollm"})
    if tok is not None:
        tok.save(folder / "tokenizer.json")
    if card is not None:
        write_card(folder, card)


def write_card(folder: str | Path, card: dict) -> None:
    """card.json, and README.md rendered from it (``card["markdown"]`` if given)."""
    folder = Path(folder)
    atomic_write_text(folder / "card.json", json.dumps({k: v for k, v in card.items() if k != "markdown"}, indent=1))
    if "markdown" in card:
        atomic_write_text(folder / "README.md", card["markdown"])


def is_checkpoint(folder: str | Path) -> bool:
    """True for a nanollm checkpoint folder (it has ``nanollm_config.json``)."""
    return (Path(folder) / "nanollm_config.json").is_file()


def is_run(folder: str | Path) -> bool:
    """True for a training run folder of ``nanollm.cli.train`` (it has ``state.pt``)."""
    return (Path(folder) / "state.pt").is_file()


def load_config(name_or_path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint, training run or Hugging Face folder, without loading the weights."""
    folder = resolve(name_or_path)
    if is_gguf(folder):
        from . import gguf
        from .hf import config_from_hf
        return config_from_hf(gguf.hf_config(gguf.read_gguf(folder)))
    if is_checkpoint(folder):
        path = folder / "nanollm_config.json"
        try:
            return ModelConfig.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError) as e:
            raise ValueError(f"cannot read {path}: {e}") from e
    if is_run(folder):
        st = torch.load(folder / "state.pt", map_location="cpu", weights_only=True, mmap=True)
        return ModelConfig.from_dict(st["model_config"])
    from .hf import config_from_hf, is_hf_folder, read_hf_config
    if is_hf_folder(folder):
        return config_from_hf(read_hf_config(folder))
    raise ValueError(_not_a_checkpoint(folder))


def load_tokenizer(name_or_path: str | Path):
    """The tokenizer of a checkpoint, run or Hugging Face folder (``None`` for a Hugging Face folder without a
    supported tokenizer file), without loading the weights."""
    folder = resolve(name_or_path)
    if is_gguf(folder):
        from . import gguf
        return gguf_tokenizer(gguf.read_gguf(folder))
    if is_checkpoint(folder) or is_run(folder):
        return Tokenizer.load(folder / "tokenizer.json")
    from .hf import is_hf_folder, read_hf_config
    if is_hf_folder(folder):
        return hf_tokenizer(folder, read_hf_config(folder))
    if (folder / "tokenizer.json").is_file():
        return Tokenizer.load(folder / "tokenizer.json")
    raise ValueError(_not_a_checkpoint(folder))


def load_card(name_or_path: str | Path) -> dict:
    """The card of a checkpoint (``{}`` if it has none; a Hugging Face folder gives its source and config)."""
    folder = resolve(name_or_path)
    if is_gguf(folder):
        from . import gguf
        return gguf_card(folder, gguf.hf_config(gguf.read_gguf(folder)))
    if is_checkpoint(folder):
        path = folder / "card.json"
        try:
            return json.loads(path.read_text()) if path.exists() else {}
        except ValueError as e:
            raise ValueError(f"cannot read {path}: {e}") from e
    from .hf import is_hf_folder, read_hf_config
    if is_hf_folder(folder):
        return {"source": "huggingface", "config": read_hf_config(folder)}
    if is_run(folder):
        return {}
    raise ValueError(_not_a_checkpoint(folder))


def _not_a_checkpoint(folder: Path) -> str:
    return (f"{folder} is neither a nanollm checkpoint (nanollm_config.json) nor a Hugging Face folder "
            "(config.json + model.safetensors / pytorch_model.bin)")


def load_nanollm(folder: str | Path, device: str = "cpu") -> tuple[Transformer, Tokenizer, dict]:
    folder = Path(folder)
    for f in ("nanollm_config.json", "model.safetensors", "tokenizer.json"):
        if not (folder / f).exists():
            raise ValueError(f"checkpoint folder {folder} has no {f}")
    return load_model(folder, device), Tokenizer.load(folder / "tokenizer.json"), load_card(folder)


def load_model(folder: str | Path, device: str = "cpu") -> Transformer:
    """The model of a nanollm checkpoint folder (config and weights, checked against each other), in eval
    mode; the tokenizer and card are not read."""
    folder = Path(folder)
    for f in ("nanollm_config.json", "model.safetensors"):
        if not (folder / f).exists():
            raise ValueError(f"checkpoint folder {folder} has no {f}")
    try:
        config = ModelConfig.from_dict(json.loads((folder / "nanollm_config.json").read_text()))
    except (ValueError, TypeError) as e:
        raise ValueError(f"cannot read {folder / 'nanollm_config.json'}: {e}") from e
    state = safetensors.load_file(folder / "model.safetensors")      # raises SafetensorsError if corrupt
    model = Transformer(config)
    if config.tie_embeddings:
        state["lm_head.weight"] = state.get("tok_emb.weight")
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state)
                   if state[k] is not None and tuple(state[k].shape) != tuple(expected[k].shape))
    if missing or unexpected or wrong:
        raise ValueError(f"checkpoint {folder} does not match its config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, wrong shapes {wrong[:5]}")
    model.load_state_dict(state)
    return model.to(device).eval()


class EncodingTokenizer:
    """A tiktoken Encoding with the interface the project uses: encode, decode, eot_id, vocab_size.

    ``vocab_size``: ids from it on are bytes the vocab lacks (``hf_tokenizer.mergeable_ranks`` ranks them
    past the vocab, because tiktoken needs every byte); ``encode`` drops them. (Hugging Face's byte-level BPE
    drops such a character before merging, so next to one its neighbours may merge differently.)
    """

    def __init__(self, enc, eot_id: int | None, vocab_size: int | None = None) -> None:
        self.enc, self.eot_id = enc, eot_id
        self.vocab_size = enc.n_vocab if vocab_size is None else min(vocab_size, enc.n_vocab)

    def encode(self, text: str) -> list[int]:
        ids = self.enc.encode(text, allowed_special="all")
        return ids if self.vocab_size == self.enc.n_vocab else [i for i in ids if i < self.vocab_size]

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(list(ids))

    def bpe(self) -> tuple[dict[bytes, int], str, dict[str, int]]:
        """(ranks of the vocab's own tokens, split regex, special tokens): what ``hf.export_hf`` writes.
        tiktoken keeps them in attributes it does not document; they are read here only."""
        ranks = {b: r for b, r in self.enc._mergeable_ranks.items() if r < self.vocab_size}
        return ranks, self.enc._pat_str, dict(self.enc._special_tokens)


def hf_tokenizer(folder: Path, hf_config: dict) -> EncodingTokenizer | None:
    """The tokenizer files of a Hugging Face folder, else tiktoken's cached ``gpt2`` for GPT-2, else None.

    The end-of-text id is the config's ``eos_token_id`` (the first, if a list), else ``<|endoftext|>``.
    """
    from .hf_tokenizer import load_hf_tokenizer, tiktoken_gpt2
    enc = load_hf_tokenizer(folder)
    if enc is None and hf_config.get("model_type") == "gpt2":
        try:
            enc = tiktoken_gpt2()
        except FileNotFoundError:
            return None
    if enc is None:
        return None
    eos = hf_config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    if eos is None and "<|endoftext|>" in enc.special_tokens_set:
        eos = enc.encode_single_token("<|endoftext|>")
    return EncodingTokenizer(enc, eos, hf_config.get("vocab_size"))


def gguf_tokenizer(g) -> EncodingTokenizer:
    """The tokenizer stored in a GGUF file's metadata; its end-of-text id is the file's eos token."""
    from . import gguf
    return EncodingTokenizer(gguf.encoding(g), g.metadata.get("tokenizer.ggml.eos_token_id"),
                             len(g.metadata["tokenizer.ggml.tokens"]))


def gguf_card(path: str | Path, hf_config: dict) -> dict:
    """The card of a GGUF model: where it came from and its configuration; a fetched model's card also names
    it and gives its default task suite, length and sample count (what ``methods.compare`` runs when no
    ``--tasks``, ``--length`` or ``--samples`` are given)."""
    card = {"source": "gguf", "file": str(path), "name": Path(path).stem, "config": hf_config}
    for r in fetch.REMOTES.values():
        if Path(path).name == r.filename:
            card.update(name=r.name, default_suite=list(r.default_suite), default_length=r.default_length,
                        default_samples=r.default_samples)
    return card


def load_gguf(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """(model, tokenizer, card) from a GGUF file: its weights dequantized to ``dtype`` (``gguf.py``)."""
    from . import gguf
    from .hf import config_from_hf, model_from_state, state_from_hf
    g = gguf.read_gguf(path)                      # raises ValueError for a corrupt or unsupported file
    hf_config = gguf.hf_config(g)
    config = config_from_hf(hf_config)
    config.extra["source"] = str(Path(path).resolve())
    tokenizer = gguf_tokenizer(g)                 # every metadata check before the tensors are read
    state = state_from_hf(gguf.load_tensors(g), config)
    model = model_from_state(config, state, dtype, what=str(path)).to(device)
    return model, tokenizer, gguf_card(path, hf_config)


def load(name_or_path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """(model, tokenizer, card) from a bundled name, a fetchable model's name, a nanollm checkpoint folder,
    a Hugging Face folder or a GGUF file.

    The model is in eval mode, on ``device``, its weights in ``dtype`` (default fp32; ``torch.bfloat16``
    halves the bytes a decode step reads). A Hugging Face folder without a supported tokenizer file gives
    ``tokenizer = None``.
    """
    folder = resolve(name_or_path)
    if is_gguf(folder):
        return load_gguf(folder, device, dtype)
    if (folder / "nanollm_config.json").exists():
        model, tok, card = load_nanollm(folder, device)
        return model.to(dtype), tok, card
    from .hf import is_hf_folder, load_hf
    if is_hf_folder(folder):
        model, hf_config = load_hf(folder, device=device, dtype=dtype)
        return model.eval(), hf_tokenizer(folder, hf_config), {"source": "huggingface", "config": hf_config}
    raise ValueError(_not_a_checkpoint(folder))


def export_run(run_dir: str | Path, out_dir: str | Path, card: dict | None = None) -> None:
    """Turn a training run folder (state.pt + tokenizer.json) into a checkpoint folder."""
    run = Path(run_dir)
    st = torch.load(run / "state.pt", map_location="cpu", weights_only=True)
    model = Transformer(ModelConfig.from_dict(st["model_config"]))
    model.load_state_dict(st["model"])
    save(model, Tokenizer.load(run / "tokenizer.json"), out_dir, card)
