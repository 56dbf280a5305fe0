#!/usr/bin/env python3
"""Train the small byte-level BPE tokenizer used by tests and the bundled tiny model.

The result has the same shape as GLM-5.3-Flash's tokenizer.json: no normalizer, the GLM-4 family
Split regex (Isolated) followed by ByteLevel without its own regex, a ByteLevel decoder, and the
same 36 added tokens in the same order. The base vocabulary has 2000 entries (all 256 byte
characters included) and the added tokens take ids 2000..2035, directly after it.

Training is deterministic: the corpus (tools/tokenizer/corpus.txt) is fed in a fixed order and the
Hugging Face BPE trainer breaks ties by token ids, so the same `tokenizers` version rebuilds the
same file.

Writes <out-dir>/tokenizer.json and <out-dir>/tokenizer_config.json.

Usage: python tools/tokenizer/train_tiny_tokenizer.py [--corpus PATH] [--out-dir DIR]
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from tokenizers import trainers

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CORPUS = REPO / "tools" / "tokenizer" / "corpus.txt"
DEFAULT_OUT = REPO / "examples" / "tiny" / "tokenizer"

BASE_VOCAB_SIZE = 2000

# The GLM-4 family pre-tokenizer pattern, as GLM-5.3-Flash uses it.
GLM_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GLM-5.3-Flash's added tokens in id order (154820..154855 in the released tokenizer), with their
# `special` flag. <think>, </think> and the tool / argument markers are not special, so decoding
# with skip_special keeps them.
ADDED_TOKENS = [
    ("<|endoftext|>", True),
    ("[MASK]", True),
    ("[gMASK]", True),
    ("[sMASK]", True),
    ("<sop>", True),
    ("<eop>", True),
    ("<|system|>", True),
    ("<|user|>", True),
    ("<|assistant|>", True),
    ("<|observation|>", True),
    ("<|begin_of_image|>", True),
    ("<|end_of_image|>", True),
    ("<|begin_of_video|>", True),
    ("<|end_of_video|>", True),
    ("<|begin_of_audio|>", True),
    ("<|end_of_audio|>", True),
    ("<|begin_of_transcription|>", True),
    ("<|end_of_transcription|>", True),
    ("<|code_prefix|>", True),
    ("<|code_middle|>", True),
    ("<|code_suffix|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<arg_key>", False),
    ("</arg_key>", False),
    ("<arg_value>", False),
    ("</arg_value>", False),
    ("/nothink", True),
    ("<|begin_of_box|>", True),
    ("<|end_of_box|>", True),
    ("<|image|>", True),
    ("<|video|>", True),
]
assert len(ADDED_TOKENS) == 36

TOKENIZER_CONFIG = {
    "backend": "tokenizers",
    "clean_up_tokenization_spaces": False,
    "do_lower_case": False,
    "eos_token": "<|endoftext|>",
    "model_max_length": 1048576,
    "pad_token": "<|endoftext|>",
    "padding_side": "left",
    "remove_space": False,
    "tokenizer_class": "TokenizersBackend",
}


def training_texts(lines):
    """Yields the corpus three ways: line by line, as LF paragraphs and as CRLF paragraphs, so
    that the merges also learn newline runs and Windows line endings."""
    yield from lines
    for start in range(0, len(lines), 4):
        yield "\n".join(lines[start : start + 4]) + "\n\n"
    for start in range(0, len(lines), 6):
        yield "\r\n".join(lines[start : start + 6]) + "\r\n"


def build(corpus_path):
    lines = corpus_path.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()

    tok = Tokenizer(models.BPE(byte_fallback=False, ignore_merges=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GLM_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BASE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(training_texts(lines), trainer=trainer, length=None)
    base = tok.get_vocab_size(with_added_tokens=False)
    if base != BASE_VOCAB_SIZE:
        sys.exit(f"the corpus yields only {base} base tokens, need {BASE_VOCAB_SIZE}; add text")

    for content, special in ADDED_TOKENS:
        token = AddedToken(
            content, single_word=False, lstrip=False, rstrip=False, normalized=False,
            special=special,
        )
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    for index, (content, _) in enumerate(ADDED_TOKENS):
        assert tok.token_to_id(content) == BASE_VOCAB_SIZE + index, content
    return tok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()

    tok = build(args.corpus)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "tokenizer.json"
    tok.save(str(out), pretty=True)
    config = args.out_dir / "tokenizer_config.json"
    config.write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n", encoding="utf-8")
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    print(f"wrote {out} ({out.stat().st_size} bytes, sha256 {digest}) and {config}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
