#!/usr/bin/env python3
"""Encode golden strings with Hugging Face `tokenizers` on the tiny tokenizer.

Writes tests/golden/tokenizer/tiny_encodings.json: for every case its name, the input text, the
ids `Tokenizer.encode(text, add_special_tokens=False)` returns, and `decode(ids)` with and without
skip_special_tokens. tests/unit/test_tokenizer.cpp checks glmtune's tokenizer against every case.

It also builds a second, GPT-2 style tokenizer (NFC normalizer, a bare ByteLevel pre-tokenizer with
its own regex and add_prefix_space, added tokens with single_word / lstrip / rstrip / normalized)
from the same corpus, and writes it with its encodings to tests/golden/tokenizer/gpt2_style_*.json,
so that the configurations GLM does not use are held to Hugging Face's behaviour too.

The cases cover what tends to break byte-level BPE ports: empty and whitespace-only input, CR/LF
runs, tabs, digit grouping, contractions in any case, emoji ZWJ sequences and flags, CJK
punctuation, control characters, Unicode spaces, every added token written literally and next to
text, near-misses of added tokens, and words long enough to need many merges.

Usage: python tools/golden/tokenizer_goldens.py [--tokenizer PATH] [--out-dir DIR]
"""

import argparse
import hashlib
import json
import sys
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import trainers

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TOKENIZER = REPO / "examples" / "tiny" / "tokenizer" / "tokenizer.json"
DEFAULT_OUT_DIR = REPO / "tests" / "golden" / "tokenizer"
CORPUS = REPO / "tools" / "tokenizer" / "corpus.txt"

ADDED = [
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
    "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>",
    "<|begin_of_video|>", "<|end_of_video|>", "<|begin_of_audio|>", "<|end_of_audio|>",
    "<|begin_of_transcription|>", "<|end_of_transcription|>", "<|code_prefix|>",
    "<|code_middle|>", "<|code_suffix|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>",
    "</arg_value>", "/nothink", "<|begin_of_box|>", "<|end_of_box|>", "<|image|>", "<|video|>",
]

CASES = [
    ("empty", ""),
    ("single space", " "),
    ("whitespace only", "   \t  \n "),
    ("newlines only", "\n\n\n"),
    ("crlf lines", "a\r\nb\r\n\r\nc"),
    ("lone cr", "a\rb\r\rc"),
    ("tabs", "\tindented\n\t\tdouble\ttab\t"),
    ("trailing spaces", "word   "),
    ("spaces around newline", "   \n   x"),
    ("long space run", " " * 50 + "x" + " " * 7),
    ("digits grouping", "1234567 3.14159 -42 0x1F 1e-9"),
    ("long digit run", "12345678901234567890"),
    ("digits inside words", "abc123def4567ghi 2026-09-21T14:35:07Z"),
    ("non-ascii digits", "1,234,567.89 \uff12\uff10\uff12\uff16 \u0661\u0662\u0663 \u00b2\u00b3"),
    ("spec whitespace golden", "  leading\n\n\ttabs   trailing  \r\n\r\n end"),
    ("contractions upper", "I'M HERE, YOU'RE THERE, WE'LL SEE, IT'S 'S 'T 'D 'VE"),
    ("contractions mixed", "Don't can't won't it's I'd they've We'Ll 'lL"),
    ("apostrophe variants", "it\u2019s 'long s' \u0027\u017f x'"),
    ("emoji zwj and flags", "Family \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 "
     "flag \U0001F1E9\U0001F1EA hand \U0001F44B\U0001F3FD heart \u2764\ufe0f"),
    ("emoji run", "\U0001F600\U0001F603\U0001F604\U0001F389\U0001F389!!!"),
    ("chinese", "\u4f60\u597d\uff0c\u4e16\u754c\u3002\u5de5\u5177\u8c03\u7528"),
    ("chinese punctuation", "\u201c\u5f15\u53f7\u201d\u3001\uff08\u62ec\u53f7\uff09\u300a\u4e66"
     "\u540d\u300b\u2014\u2014\u7834\u6298\u53f7\u2026\u2026\u7701\u7565\u53f7\uff01\uff1f"),
    ("mixed chinese english", "GLM\u6a21\u578bv5.3\u7684\u53c2\u6570\u91cf\u4e3a321B\u3002"),
    ("control characters", "\x00\x01\x07\x1b[0m\x7f tab\x0bvt\x0cff"),
    ("unicode spaces", "a\u00a0b\u3000c\u2028d\u2029e\u0085f\u202fg"),
    ("mongolian vowel separator", "a\u180e\u180eb \u200b\u200bc \ufeffd"),
    ("combining marks", "e\u0301 vs \u00e9, n\u0303 vs \u00f1, \u1100\u1161 vs \uac00"),
    ("other scripts", "\u041f\u0440\u0438\u0432\u0435\u0442 \u043c\u0438\u0440 "
     "\u0645\u0631\u062d\u0628\u0627 \u0928\u092e\u0938\u094d\u0924\u0947 "
     "\uc548\ub155\ud558\uc138\uc694 \u3053\u3093\u306b\u3061\u306f"),
    ("astral letters", "\U0001D518\U0001D52B\U0001D526\U0001D520 \U00020000\U00020001"),
    ("math symbols", "\u2211 \u222b \u221a\u221e \u2260 \u2264 \u2265 \u00b1 \u00d7 \u00f7 "
     "\u03c0\u03b8"),
    ("every added token", "".join(ADDED)),
    ("added tokens spaced", " ".join(ADDED)),
    ("added tokens adjacent to text",
     "abc<|user|>def<think>ghi</think>jkl/nothinkmno[gMASK]<sop>pqr\n<|assistant|>\n"),
    ("added token alone", "<|endoftext|>"),
    ("added token near misses", "<|user| <think <|endoftext|>> <<think>> [gMASK][sMASK] </think"
     " <|USER|> [gmask] /nothinking"),
    ("roles string", "[gMASK]<sop><|system|>Sys<|user|>Hallo<|assistant|><think>kurz</think>"
     "Antwort<|observation|><tool_response>ok</tool_response><|endoftext|>"),
    ("tool call", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Berlin</arg_value>"
     "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"),
    ("german prompt", "[gMASK]<sop><|system|>Reasoning Effort: Max<|system|>Du bist ein "
     "hilfreicher Assistent.<|user|>Wie gro\u00df ist der Monitor? \U0001F985<|assistant|><think>"),
    ("german umlauts", "\u00c4pfel, \u00d6l und \u00dcbungen; Stra\u00dfe, Fu\u00dfball, "
     "\u00fcberm\u00f6rgen."),
    ("long german word", "Rindfleischetikettierungs\u00fcberwachungsaufgaben\u00fcbertragungsgesetz"),
    ("long english word", "pneumonoultramicroscopicsilicovolcanoconiosis"),
    ("very long letter run", "a" * 300 + "b" * 37),
    ("long mixed word", "Donaudampfschiffahrtsgesellschaftskapit\u00e4n" * 8),
    ("python code", "def add(a, b):\n    return a + b\n\nfor i in range(10):\n"
     "    print(f\"step {i}: loss={x:.4f}\")\n"),
    ("cpp code", "int main() {\n  std::vector<int32_t> ids{1, 2, 3};\n  return ids.size() > 0 ? "
     "0 : 1;\n}\n"),
    ("json", "{\"role\": \"user\", \"content\": \"Hello!\", \"n\": [1, 22, 333, 4444]}"),
    ("url and email", "https://example.org/path?query=1&lang=en#top someone@example.com"),
    ("markdown table", "| a | b |\n|---|---|\n| 1 | 2 |\n"),
    ("prose", "The quick brown fox jumps over the lazy dog. Fine-tuning a language model starts "
     "with turning text into numbers, one token at a time."),
]


# Cases for the GPT-2 style tokenizer: added-token flags and NFC.
GPT2_STYLE_CASES = [
    ("empty", ""),
    ("prefix space", "hello world"),
    ("already spaced", " hello"),
    ("single_word alone", "SW"),
    ("single_word spaced", "a SW b"),
    ("single_word glued left", "xSW"),
    ("single_word glued right", "SWx"),
    ("single_word next to underscore", "_SW SW_"),
    ("single_word next to digit", "1SW SW2"),
    ("single_word next to superscript", "\u00b2SW"),
    ("single_word next to combining mark", "SW\u0301"),
    ("single_word next to zwj", "\u200dSW"),
    ("single_word next to punctuation", "(SW)"),
    ("lstrip", "a   LS b"),
    ("lstrip unicode space", "a\u00a0\u3000LS"),
    ("lstrip at start", "  LS"),
    ("lstrip after token", "LS LS  LS"),
    ("rstrip", "a RS   b"),
    ("rstrip newline", "RS\n\nx"),
    ("lstrip and rstrip", "x  LRS  y"),
    ("raw special", "a<raw>b"),
    ("normalized token", "a<norm>b"),
    ("normalized token decomposed", "cafe\u0301! caf\u00e9!"),
    ("nfc compose", "e\u0301 n\u0303 A\u030a \u1100\u1161\u11a8"),
    ("nfc reorder", "q\u0307\u0323 \u1e0b\u0323"),
    ("nfc singleton", "\u212b \u2126 \uf900"),
    ("nfc exclusion", "\u0958 \u2adc"),
    ("gpt2 regex", "it's 12345 hello!!  world\n\n  x"),
    ("added tokens mixed", "SW<raw>LS RS<norm>"),
]

GPT2_STYLE_ADDED = [
    AddedToken("SW", single_word=True, lstrip=False, rstrip=False, normalized=False),
    AddedToken("LS", single_word=False, lstrip=True, rstrip=False, normalized=False),
    AddedToken("RS", single_word=False, lstrip=False, rstrip=True, normalized=False),
    AddedToken("LRS", single_word=False, lstrip=True, rstrip=True, normalized=False),
    AddedToken("<norm>", single_word=False, lstrip=False, rstrip=False, normalized=True),
    AddedToken("caf\u00e9!", single_word=False, lstrip=False, rstrip=False, normalized=True),
]
GPT2_STYLE_SPECIAL = [
    AddedToken("<raw>", single_word=False, lstrip=False, rstrip=False, normalized=False,
               special=True),
]


def build_gpt2_style():
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tok.train_from_iterator(lines, trainer=trainer)
    tok.add_tokens(GPT2_STYLE_ADDED)
    tok.add_special_tokens(GPT2_STYLE_SPECIAL)
    return tok


def encode_cases(tok, case_list, require_round_trip):
    names = [name for name, _ in case_list]
    assert len(set(names)) == len(names), "case names must be unique"
    cases = []
    for name, text in case_list:
        ids = tok.encode(text, add_special_tokens=False).ids
        decoded = tok.decode(ids, skip_special_tokens=False)
        if require_round_trip and decoded != text:
            sys.exit(f"case {name!r} does not round-trip through HF decode")
        cases.append({
            "name": name,
            "text": text,
            "ids": ids,
            "decoded": decoded,
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
        })
    return cases


def write_json(path, data):
    path.write_text(json.dumps(data, indent=1, ensure_ascii=True) + "\n", encoding="utf-8")


def relative_name(path):
    path = path.resolve()
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer.from_file(str(args.tokenizer))
    write_json(args.out_dir / "tiny_encodings.json", {
        "tokenizer": relative_name(args.tokenizer),
        "tokenizer_sha256": hashlib.sha256(args.tokenizer.read_bytes()).hexdigest(),
        "tokenizers_version": tokenizers.__version__,
        "cases": encode_cases(tok, CASES, require_round_trip=True),
    })

    gpt2 = build_gpt2_style()
    gpt2_path = args.out_dir / "gpt2_style_tokenizer.json"
    gpt2.save(str(gpt2_path), pretty=False)
    write_json(args.out_dir / "gpt2_style_encodings.json", {
        "tokenizer": relative_name(gpt2_path),
        "tokenizer_sha256": hashlib.sha256(gpt2_path.read_bytes()).hexdigest(),
        "tokenizers_version": tokenizers.__version__,
        "cases": encode_cases(gpt2, GPT2_STYLE_CASES, require_round_trip=False),
    })
    print(f"wrote {len(CASES)} + {len(GPT2_STYLE_CASES)} cases to {args.out_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
