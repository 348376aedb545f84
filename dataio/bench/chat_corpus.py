"""Chat corpora made on the spot (tests and ``tools.bench_chat``; nothing downloaded): a Hugging Face tokenizer
directory (a byte-level BPE trained on generated text, with a ChatML template written with and without
``{% generation %}`` markers) and generated conversations, short ones or long-tailed ones."""

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


def long_tailed_conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """``n`` conversations of long-tailed size, as chat corpora are: turns 1 + geometric(0.35) (mean ~2.9),
    words per message log-normal (median 30, sigma 1.0: p99 ~300), an optional system prompt. With a
    word-level vocabulary that is a median of ~250 tokens and a tail past 4k."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": sentence(rng, 5, 20)}] if rng.random() < 0.3 else []
        turns = 1
        while rng.random() > 0.35 and turns < 40:
            turns += 1
        for _ in range(turns):
            for role in ("user", "assistant"):
                words = max(1, min(3000, round(rng.lognormvariate(3.4, 1.0))))
                messages.append({"role": role, "content": " ".join(rng.choice(WORDS) for _ in range(words))})
        out.append(messages)
    return out
