"""
Checkpoint folders: save, load, and the bundled models.

A nanollm checkpoint is a folder of ``nanollm_config.json``, ``model.safetensors``, ``tokenizer.json``,
``card.json`` and ``README.md``. ``load(name_or_path)`` takes a bundled checkpoint's name, a checkpoint folder,
a Hugging Face-format folder (``hf.py``), a GGUF file (``gguf.py``) or a fetched model's name (``fetch.py``;
nothing is downloaded at run time), and returns ``(model, tokenizer, card)``; ``load_config``,
``load_tokenizer`` and ``load_card`` read one part without the weights. Every file is written atomically,
and a folder read is checked before anything is built (regular files, JSON fields and types, tensor names
and shapes, finite weights).

Details: nanollm/inside.md, section "io/checkpoint.py: checkpoint folders".
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import Tensor

from ..attention import ATTENTION
from ..checks import check_finite_weights, is_int
from ..config import ModelConfig
from ..model import Transformer
from . import fetch, safetensors
from .files import atomic_write_text, open_data_file, read_json, removed_on_failure
from .hf import check_state, config_from_hf, meta_tensors, model_from_state
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


CHECKPOINT_FILES = ("nanollm_config.json", "model.safetensors", "tokenizer.json", "card.json", "README.md")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def weights_sha256(name_or_path: str | Path) -> dict[str, str]:
    """SHA-256 of the checkpoint's weights, by file name: a GGUF file's own, or a folder's weight files (its
    ``*.safetensors``, ``*.bin``, ``*.pt``, ``*.gguf``), so that a result names the exact weights it ran."""
    path = resolve(name_or_path)
    files = [path] if path.is_file() else sorted(f for f in path.iterdir() if f.suffix in WEIGHT_SUFFIXES)
    out = {}
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                h.update(block)
        out[f.name] = h.hexdigest()
    return out


def save(model: Transformer, tok: Tokenizer | None, folder: str | Path, card: dict | None = None) -> None:
    """Write a checkpoint folder; ``tok=None`` for a model whose tokens are not text (no tokenizer.json:
    load it with ``load_model``). A failed save (a full disk, Ctrl-C) removes the files and folders it
    created (``files.removed_on_failure``)."""
    folder = Path(folder)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        state.pop("lm_head.weight")
    with removed_on_failure(folder, CHECKPOINT_FILES):
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / "nanollm_config.json", json.dumps(model.config.to_dict(), indent=1))
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


# The attention modules a config read from a file may name: the project's own, by fixed names. A config file
# is data: were "evil_mod:X" allowed, a downloaded checkpoint would run the evil_mod.py beside it. (Code that
# builds a ModelConfig may still name a module of its own, and a name code registers in attention.ATTENTION
# counts too.)
FILE_ATTENTION = ("causal", "methods.tensor_attention:TensorAttention")


def config_from_file(d, path) -> ModelConfig:
    """The ModelConfig of a JSON object read from ``path`` (``ModelConfig.from_dict``), with an ``attention``
    from ``FILE_ATTENTION`` or ``attention.ATTENTION`` only, or a ValueError naming the file and the field."""
    if not isinstance(d, dict):
        raise ValueError(f"{path}: a model config must be an object of ModelConfig fields, got {type(d).__name__}")
    allowed = tuple(dict.fromkeys([*FILE_ATTENTION, *ATTENTION]))
    if "attention" in d and d["attention"] not in allowed:
        raise ValueError(f"{path}: attention {d['attention']!r:.100} is not one of the project's attention modules "
                         f"({', '.join(map(repr, allowed))}); a config file names one, never code to import")
    try:
        return ModelConfig.from_dict(d)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig in a checkpoint's ``nanollm_config.json``."""
    return config_from_file(read_json(path, "config file"), path)


# What nanollm.cli.train saves in state.pt, and the type of each
RUN_STATE = {"model": dict, "opt": dict, "model_config": dict, "step": int, "stage": int, "stage_start": int,
             "elapsed": (int, float)}


def load_run_state(path: str | Path, device: str | torch.device = "cpu") -> dict:
    """A training run's ``state.pt``: ``torch.load(weights_only=True)``, which unpickles tensors and plain
    containers only (a crafted pickle runs no code), then checked to be the dict ``nanollm.cli.train`` saves.
    Any failure (a crafted pickle, garbage, an empty file, a missing field) is one ValueError naming the file.
    Every reader of a state.pt goes through here: ``load_config``, ``export_run``, ``nanollm.cli.card`` and
    ``nanollm.cli.train --resume``."""
    with open_data_file(path, "training state") as f:
        st = safetensors.torch_load(f, path, device)
    if not isinstance(st, dict):
        raise ValueError(f"{path}: expected the dict nanollm.cli.train saves, got {type(st).__name__}")
    for key, kind in RUN_STATE.items():
        value = st.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"{path}: {key} must be {getattr(kind, '__name__', 'a number')}, got {value!r:.100}")
    if not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in st["model"].items()):
        raise ValueError(f"{path}: model must map parameter names to tensors")
    return st


def load_config(name_or_path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint, training run or Hugging Face folder, without loading the weights."""
    folder = resolve(name_or_path)
    if is_gguf(folder):
        from . import gguf
        return config_from_hf(gguf.hf_config(gguf.read_gguf(folder)), folder)
    if is_checkpoint(folder):
        return read_config(folder / "nanollm_config.json")
    if is_run(folder):
        path = folder / "state.pt"
        return config_from_file(load_run_state(path)["model_config"], path)
    from .hf import is_hf_folder, read_hf_config
    if is_hf_folder(folder):
        return config_from_hf(read_hf_config(folder), folder / "config.json")
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


MAX_SAMPLES = 10_000      # samples per task, length and mode: a card's default_samples, card --samples
# The fields of card.json that the code reads, and what each must be (a card may hold others)
CARD_TEXT = ("name", "summary", "tokenizer", "train_command", "training_notes", "hardware", "eval_command",
             "limitations", "source", "file")
CARD_COUNTS = {"steps": (0, None), "n_params": (0, None), "eval_seed": (0, None), "default_length": (1, None),
               "n_samples": (1, MAX_SAMPLES), "default_samples": (1, MAX_SAMPLES)}
CARD_OBJECTS = ("model_config", "config")


def check_card(card, path) -> dict:
    """A model card read from ``path``: an object whose known fields have their types (``CARD_TEXT`` strings,
    ``CARD_COUNTS`` integers in range, ``CARD_OBJECTS`` objects, ``default_suite`` a list of task names,
    ``wall_time_s`` a number >= 0). ``experiments.compare`` runs ``default_samples`` samples per task and mode, so
    that is capped at ``MAX_SAMPLES``."""
    from ..data.tasks import ALL_TASKS

    def fail(key, expected):
        raise ValueError(f"{path}: {key} must be {expected}, got {card[key]!r:.100}")
    if not isinstance(card, dict):
        raise ValueError(f"{path}: a model card must be a JSON object, got {type(card).__name__}")
    for key in CARD_TEXT:
        if key in card and not isinstance(card[key], str):
            fail(key, "a string")
    for key, (low, high) in CARD_COUNTS.items():
        if key in card and not (is_int(card[key]) and card[key] >= low and (high is None or card[key] <= high)):
            fail(key, f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]")
    for key in CARD_OBJECTS:
        if key in card and not isinstance(card[key], dict):
            fail(key, "an object")
    if "default_suite" in card and not (isinstance(card["default_suite"], list)
                                        and all(t in ALL_TASKS for t in card["default_suite"])):
        fail("default_suite", f"a list of task names ({', '.join(ALL_TASKS)})")
    wall = card.get("wall_time_s", 0)
    if not isinstance(wall, (int, float)) or isinstance(wall, bool) or not 0 <= wall < float("inf"):
        fail("wall_time_s", "a number >= 0")
    return card


def load_card(name_or_path: str | Path) -> dict:
    """The card of a checkpoint (``{}`` if it has none; a Hugging Face folder gives its source and config)."""
    folder = resolve(name_or_path)
    if is_gguf(folder):
        from . import gguf
        return gguf_card(folder, gguf.hf_config(gguf.read_gguf(folder)))
    if is_checkpoint(folder):
        path = folder / "card.json"
        return check_card(read_json(path, "model card"), path) if path.exists() else {}
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
    """The model of a nanollm checkpoint folder, in eval mode; the tokenizer and card are not read. The
    weights file's tensors are checked against the config on its header (names and shapes) before any data
    is read or anything built, then for finite values."""
    folder = Path(folder)
    for f in ("nanollm_config.json", "model.safetensors"):
        if not (folder / f).exists():
            raise ValueError(f"checkpoint folder {folder} has no {f}")
    config = read_config(folder / "nanollm_config.json")
    path = folder / "model.safetensors"
    check_state(config, _with_tied_head(meta_tensors(safetensors.read_header(path)[0]), config), path)
    state = safetensors.load_file(path)
    check_finite_weights(state, path)
    return model_from_state(config, _with_tied_head(state, config), torch.float32, what=str(path)).to(device)


def _with_tied_head(state: dict, config: ModelConfig) -> dict:
    """A saved state dict with the tied lm_head (which ``save`` leaves out) put back."""
    return {**state, "lm_head.weight": state.get("tok_emb.weight")} if config.tie_embeddings else state


class EncodingTokenizer:
    """A tiktoken Encoding with the interface the project uses: encode, decode, eot_id, vocab_size.

    ``vocab_size``, the model's: ids from it on are bytes the vocab lacks (``hf_tokenizer.mergeable_ranks`` ranks
    them past the vocab, because tiktoken needs every byte); ``encode`` drops them. (Hugging Face's byte-level
    BPE drops such a character before merging, so next to one its neighbours may merge differently.) A model
    whose embedding has more rows than the tokenizer has tokens (Qwen's pad theirs) may emit an id no token
    has: ``decode`` reads it as nothing, as transformers does. A tokenizer whose tokens pass ``vocab_size``
    is refused: the model could not read them.
    """

    def __init__(self, enc, eot_id: int | None, vocab_size: int | None = None) -> None:
        self.enc, self.eot_id = enc, eot_id
        if vocab_size is not None:                   # merged and special tokens past the embedding: refused
            top = max([r for b, r in enc._mergeable_ranks.items() if len(b) > 1] + [*enc._special_tokens.values()],
                      default=-1)
            if top >= vocab_size:
                raise ValueError(f"the tokenizer has a token of id {top}, past the model's vocab_size {vocab_size} "
                                 "(its embedding's rows): the tokenizer does not belong to this model")
        self.vocab_size = enc.n_vocab if vocab_size is None else min(vocab_size, enc.n_vocab)

    def encode(self, text: str) -> list[int]:
        ids = self.enc.encode(text, allowed_special="all")
        return ids if self.vocab_size == self.enc.n_vocab else [i for i in ids if i < self.vocab_size]

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode([i for i in ids if i < self.vocab_size])      # an id past every token: nothing

    def bpe(self) -> tuple[dict[bytes, int], str, dict[str, int]]:
        """(ranks of the vocab's own tokens, split regex, special tokens): what ``hf.export_hf`` writes.
        tiktoken keeps them in attributes it does not document; they are read here only."""
        ranks = {b: r for b, r in self.enc._mergeable_ranks.items() if r < self.vocab_size}
        return ranks, self.enc._pat_str, dict(self.enc._special_tokens)


def hf_tokenizer(folder: Path, hf_config: dict) -> EncodingTokenizer | None:
    """The tokenizer files of a Hugging Face folder, else tiktoken's cached ``gpt2`` for GPT-2, else None.

    The end-of-text id is the config's ``eos_token_id`` (the first, if a list), else ``<|endoftext|>``; it and
    ``vocab_size`` are checked first (an error naming config.json and the field).
    """
    from .hf import Fields
    from .hf_tokenizer import MAX_ID, load_hf_tokenizer, tiktoken_gpt2
    fields = Fields(hf_config, Path(folder) / "config.json")
    fields.token_ids("eos_token_id", fields.integer("vocab_size", None) or MAX_ID)
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
    try:
        return EncodingTokenizer(enc, eos, hf_config.get("vocab_size"))
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None


def gguf_tokenizer(g) -> EncodingTokenizer:
    """The tokenizer stored in a GGUF file's metadata; its end-of-text id is the file's eos token."""
    from . import gguf
    return EncodingTokenizer(gguf.encoding(g), g.metadata.get("tokenizer.ggml.eos_token_id"),
                             len(g.metadata["tokenizer.ggml.tokens"]))


def gguf_card(path: str | Path, hf_config: dict) -> dict:
    """The card of a GGUF model: where it came from and its configuration; a fetched model's card also names
    it and gives its default task suite, length and sample count (what ``experiments.compare`` runs when no
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
    from .hf import state_from_hf
    g = gguf.read_gguf(path)                      # raises ValueError for a corrupt or unsupported file
    hf_config = gguf.hf_config(g)
    config = config_from_hf(hf_config, path)
    config.extra["source"] = str(Path(path).resolve())
    tokenizer = gguf_tokenizer(g)                 # every metadata check before the tensors are read
    check_state(config, state_from_hf(gguf.meta_tensors(g), config, path), path)    # the header's shapes
    state = state_from_hf(gguf.load_tensors(g), config, path)
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
    path = run / "state.pt"
    st = load_run_state(path)
    config = config_from_file(st["model_config"], path)
    check_finite_weights(st["model"], path)
    model = model_from_state(config, st["model"], torch.float32, what=str(path))
    save(model, Tokenizer.load(run / "tokenizer.json"), out_dir, card)
