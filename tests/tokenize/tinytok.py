"""A tiny BPE tokenizer trained in-process and written in the ``--tokenizer-dir`` layout.

Nothing comes from a model hub: tests train a 300-token byte-level BPE on a fixed corpus, so the
ids are deterministic for a given ``tokenizers`` version and every test derives expectations from
the same ``Tokenizer`` object instead of hard-coding ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
CORPUS = ["hello world the quick brown fox jumps over the lazy dog"] * 50 + [
    "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9"
] * 20

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train(with_bos_post_processor: bool = False) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    if with_bos_post_processor:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", bos)]
        )
    return tok


def write_model(
    root: Path,
    model_id: str,
    *,
    template: str | list[dict[str, str]] | None = CHAT_TEMPLATE,
    config: dict[str, object] | None = None,
    with_bos_post_processor: bool = False,
    template_file: str | None = None,
) -> Tokenizer:
    """Write ``root/<model_id>/tokenizer.json`` (+ config); returns the tokenizer written."""
    d = root / model_id
    d.mkdir(parents=True, exist_ok=True)
    tok = train(with_bos_post_processor)
    tok.save(str(d / "tokenizer.json"))
    cfg: dict[str, object] = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "__type": "AddedToken"},
        "unk_token": "<unk>",
    }
    if template is not None:
        cfg["chat_template"] = template
    if config is not None:
        cfg.update(config)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    if template_file is not None:
        (d / "chat_template.jinja").write_text(template_file, encoding="utf-8")
    return tok
