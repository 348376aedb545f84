"""Chat test data made in the tests: a Hugging Face tokenizer directory (a byte-level BPE trained on generated
text, with a ChatML template written with and without ``{% generation %}`` markers) and conversations."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "the a river mill wheel water stone channel flows turns grinds grain miller morning evening "
    "what why how is are does can you tell me about please thanks yes no because of and to in on"
).split()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML: the assistant's text and its <|im_end|>\n are trained (what the model must learn to write)
TEMPLATE_MARKED = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATE_PLAIN = TEMPLATE_MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# raises on a conversation whose first message is not the system's
TEMPLATE_STRICT = (
    "{% if messages[0]['role'] != 'system' %}{{ raise_exception('conversations must start with a system message') }}"
    "{% endif %}" + TEMPLATE_MARKED
)


def sentence(rng: random.Random, low: int = 3, high: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def make_tokenizer_dir(path: Path, template: str = TEMPLATE_MARKED, vocab_size: int = 300) -> Path:
    """A tokenizer directory: tokenizer.json (byte-level BPE trained here) + tokenizer_config.json with ``template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([sentence(rng) for _ in range(2000)], trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def conversations(
    n: int,
    seed: int = 0,
    max_turns: int = 3,
    words: tuple[int, int] = (3, 12),
    answer_words: tuple[int, int] | None = None,
) -> list[list[dict]]:
    """``n`` conversations: an optional system message, then 1..max_turns user/assistant exchanges (``words``
    per message, ``answer_words`` per assistant message when given)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": sentence(rng)}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, max_turns)):
            messages.append({"role": "user", "content": sentence(rng, *words)})
            messages.append({"role": "assistant", "content": sentence(rng, *(answer_words or words))})
        out.append(messages)
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
