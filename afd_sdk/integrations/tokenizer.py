"""A real tokenizer for the tiny checkpoints: word level, built locally with ``tokenizers``, saved beside the model.

Text prompts, chat templates and detokenisation then work end to end in any
engine that loads a Hugging Face tokenizer (``vllm serve``, transformers),
without downloading anything. The vocabulary is exactly the model's
``vocab_size`` (so every id a random model samples decodes): a few special
tokens, punctuation, a short list of English words, then generated syllable
words. Unknown words encode as ``<unk>``.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from afd_sdk.errors import AFDConfigError

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "save_tiny_tokenizer", "tiny_vocabulary"]

#: ``<unk>`` 0, ``<s>`` 1 (prepended to every encoding), ``</s>`` 2 (end of sequence), then the chat roles
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
#: a minimal chat template: each message as ``<|role|> content``, then ``<|assistant|>`` to answer
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_PUNCTUATION = (".", ",", "?", "!")
_WORDS = (
    "the a an and or of to in on at is was are be it this that with for as by from not but "
    "cat sat mat dog bird fish tree sun moon star sea sky red blue green big small old new good one two three "
    "hello world model expert token layer attention ffn split run fast slow"
).split()
_MIN_VOCAB = len(SPECIAL_TOKENS) + len(_PUNCTUATION) + 1


def tiny_vocabulary(vocab_size: int) -> list[str]:
    """The ``vocab_size`` tokens in id order: specials, punctuation, English words, then syllable words."""
    if vocab_size < _MIN_VOCAB:
        raise AFDConfigError(
            f"vocab_size={vocab_size} is too small for the tiny tokenizer; expected at least {_MIN_VOCAB}",
            key="vocab_size",
            value=vocab_size,
        )
    syllables = ["".join(p) for p in itertools.product("bdfgklmnprstvz", "aeiou")]
    # two-syllable words first (4,900), then three (343,000), ...: as many as any vocabulary needs
    generated = ("".join(p) for n in itertools.count(2) for p in itertools.product(syllables, repeat=n))
    seen = set(_WORDS)
    fill = (w for w in generated if w not in seen)
    base = [*SPECIAL_TOKENS, *_PUNCTUATION, *_WORDS]
    return [*base[:vocab_size], *itertools.islice(fill, max(0, vocab_size - len(base)))]


def save_tiny_tokenizer(out_dir: str | Path, vocab_size: int, *, model_max_length: int = 2048) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with :data:`CHAT_TEMPLATE`) into ``out_dir``.

    Also points the checkpoint's ``config.json`` / ``generation_config.json``
    ``bos_token_id`` / ``eos_token_id`` at ``<s>`` / ``</s>``, so engines stop
    on the tokenizer's end-of-sequence token. Returns ``out_dir``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = tiny_vocabulary(vocab_size)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins words with spaces, tidies punctuation
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<unk>",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    for name in ("config.json", "generation_config.json"):
        path = out / name
        if path.exists():
            data = json.loads(path.read_text())
            data.update(bos_token_id=1, eos_token_id=2)
            if name == "config.json" and isinstance(data.get("text_config"), dict):
                data["text_config"].update(bos_token_id=1, eos_token_id=2)
            path.write_text(json.dumps(data, indent=2))
    return out
