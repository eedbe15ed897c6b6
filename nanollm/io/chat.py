"""
An instruct model's chat template: the text it was trained to see around a user's message, read from its
checkpoint and rendered the way transformers' ``apply_chat_template`` renders it (Jinja2, sandboxed).

    prefix, suffix = chat_wrap(chat_template("path/to/Qwen2.5-0.5B-Instruct"))
    text = prefix + "the user's message" + suffix          # the assistant's answer follows

The template is rendered once, with one user message holding a placeholder and the generation prompt
added, and cut at the placeholder: a prompt is then ``prefix + message + suffix``, so the evaluation can feed
a context and a question as separate chunks (``prefix + context``, then ``question + suffix``).

Where a checkpoint keeps it: a Hugging Face folder's ``chat_template.jinja`` (transformers 5) or the
``chat_template`` field of its ``tokenizer_config.json`` (a string, or a list of named templates: the
``default`` one); a GGUF file's ``tokenizer.chat_template`` metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

PLACEHOLDER = "\x00MESSAGE\x00"


def chat_template(name_or_path: str | Path) -> str | None:
    """The checkpoint's chat template, or None if it has none."""
    from .checkpoint import is_gguf, resolve
    folder = resolve(name_or_path)
    if is_gguf(folder):
        from . import gguf
        template = gguf.read_gguf(folder).metadata.get("tokenizer.chat_template")
        return template if isinstance(template, str) and template else None
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    config = folder / "tokenizer_config.json"
    if not config.is_file():
        return None
    template = json.loads(config.read_text()).get("chat_template")
    if isinstance(template, list):                       # named templates: the default one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) and template else None


def render(template: str, messages: list[dict], add_generation_prompt: bool = True, **tokens) -> str:
    """The template rendered as transformers renders it: a sandboxed Jinja2 environment that trims blocks,
    ``raise_exception`` for templates that check their input, and the special tokens (``bos_token``, ...)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(f"the chat template refuses: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            **tokens)


def chat_wrap(template: str, **tokens) -> tuple[str, str]:
    """(prefix, suffix): the text before and after one user message, the assistant's turn opened after it."""
    text = render(template, [{"role": "user", "content": PLACEHOLDER}], **tokens)
    if text.count(PLACEHOLDER) != 1:
        raise ValueError("the chat template does not show the user's message once; it cannot wrap a prompt")
    prefix, suffix = text.split(PLACEHOLDER)
    return prefix, suffix
