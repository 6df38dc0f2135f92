"""The synthetic checkpoints' tokenizer: a byte-level BPE trained deterministically on the text
shipped in assets/corpus.txt, plus GLM-5.3-Flash's special and markup tokens at fixed low ids.

Control tokens (role markers, [gMASK], <sop>, media markers) are `special` and vanish when
decoding with skip_special_tokens; the markup tokens (<think>, <tool_call>, <arg_key>, ...)
are ordinary added tokens so that they survive decoding and the output parser sees them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

CORPUS_PATH = Path(__file__).parent / "assets" / "corpus.txt"

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
    "<|image|>",
    "<|video|>",
)
MARKUP_TOKENS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
)
# GLM-5.3-Flash stops on end-of-text and on the markers that open the user's or a tool's turn.
EOS_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")


@dataclass(frozen=True, slots=True)
class TokenIds:
    """Ids of the tokens the config and the chat format refer to."""

    pad: int
    eos: tuple[int, ...]
    image: int
    video: int
    image_start: int
    image_end: int
    video_start: int
    video_end: int


def token_id(name: str) -> int:
    order = SPECIAL_TOKENS + MARKUP_TOKENS
    if name not in order:
        raise KeyError(f"{name} is not one of the synthetic tokenizer's fixed tokens")
    return order.index(name)


def token_ids() -> TokenIds:
    return TokenIds(
        pad=token_id("<|endoftext|>"),
        eos=tuple(token_id(t) for t in EOS_TOKENS),
        image=token_id("<|image|>"),
        video=token_id("<|video|>"),
        image_start=token_id("<|begin_of_image|>"),
        image_end=token_id("<|end_of_image|>"),
        video_start=token_id("<|begin_of_video|>"),
        video_end=token_id("<|end_of_video|>"),
    )


def train_tokenizer(vocab_size: int):
    """Train the BPE (deterministic: same corpus and vocab_size give the same tokenizer.json)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    fixed = SPECIAL_TOKENS + MARKUP_TOKENS
    if vocab_size < 256 + len(fixed):
        raise ValueError(
            f"vocab_size {vocab_size} is too small for 256 bytes + {len(fixed)} tokens"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(fixed),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS_PATH.read_text(encoding="utf-8")], trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the shipped corpus yields {tok.get_vocab_size()} tokens, not {vocab_size}; "
            "choose a smaller vocab_size"
        )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    for name in fixed:
        if tok.token_to_id(name) != token_id(name):
            raise AssertionError(
                f"{name} got id {tok.token_to_id(name)}, expected {token_id(name)}"
            )
    return tok


def write_tokenizer(out_dir: Path, vocab_size: int, chat_template: str, max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json into out_dir."""
    tok = train_tokenizer(vocab_size)
    tok.save(str(out_dir / "tokenizer.json"), pretty=False)
    ids = token_ids()
    added = {
        str(token_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t in SPECIAL_TOKENS,
        }
        for t in SPECIAL_TOKENS + MARKUP_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "do_lower_case": False,
        "model_max_length": max_length,
        "padding_side": "left",
        "chat_template": chat_template,
    }
    write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    generation_config = {
        "eos_token_id": list(ids.eos),
        "pad_token_id": ids.pad,
        "do_sample": False,
    }
    write_json(out_dir / "generation_config.json", generation_config)


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
