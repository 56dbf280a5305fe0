#!/usr/bin/env python3
"""Single-thread encode throughput of Hugging Face `tokenizers`, to compare with glmtune's
`bench_tokenizer` (BM_TokenizerEncodeSerial) on the same text and machine.

Subcommands:
  make-text OUT        writes about 4 MB of mixed text as JSONL, one JSON string (a document of a
                       few KB) per line: corpus lines and the bundled example data, shuffled with a
                       fixed seed and salted with numbers and identifiers. bench_tokenizer reads the
                       same file through GLMTUNE_BENCH_TEXT, so both sides encode identical input.
  train-large OUT_DIR  trains a large-vocabulary tokenizer (default 100k base tokens) with the
                       bundled tokenizer's pre-tokenizer and added tokens on a generated corpus, to
                       measure how vocabulary size affects speed. Not committed: rebuild it.
  bench                encodes every document with `Tokenizer.encode` (one thread: encode_batch
                       would use the Rayon pool) and prints MB/s per pass plus the median.

Usage:
  RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false python bench/tokenizer_vs_hf.py bench \
      --tokenizer examples/tiny/tokenizer/tokenizer.json --text /tmp/bench_text.jsonl --passes 7
"""

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Must be set before tokenizers starts its thread pool.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def source_lines():
    lines = (REPO / "tools/tokenizer/corpus.txt").read_text(encoding="utf-8").splitlines()
    # The example data adds chat-shaped text (JSON, CJK, Spanish, code-like snippets).
    for name in ("chat.jsonl", "text.jsonl"):
        path = REPO / "examples/tiny/data" / name
        lines += [l for l in path.read_text(encoding="utf-8").splitlines() if l.strip()]
    return [l for l in lines if l.strip()]


def make_text(out, megabytes):
    lines = source_lines()
    rng = random.Random(1234)
    docs, doc, total = [], [], 0
    doc_bytes = 0
    while total < megabytes * (1 << 20):
        piece = rng.choice(lines)
        salt = rng.randrange(4)
        if salt == 0:
            piece += f" id_{rng.randrange(100000)}"
        elif salt == 1:
            piece += f" {rng.randrange(1 << 32)}.{rng.randrange(1000)}"
        piece += "\n"
        doc.append(piece)
        doc_bytes += len(piece.encode("utf-8"))
        if doc_bytes > 4096:
            docs.append("".join(doc))
            total += doc_bytes
            doc, doc_bytes = [], 0
    with open(out, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    print(f"wrote {out}: {len(docs)} documents, {total / 1e6:.2f} MB", file=sys.stderr)


def generated_corpus(megabytes, seed=7):
    """Zipf-distributed words from a large synthetic lexicon (Latin, Cyrillic and CJK syllables),
    so that BPE finds enough distinct merges for a 100k vocabulary."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwxz" for v in "aeiou"]
    syllables += [c + v for c in "бвгдклмнпрст" for v in "аеиоу"]
    cjk = [chr(0x4E00 + i) for i in range(3000)]
    lexicon = []
    for _ in range(400000):
        if rng.random() < 0.2:
            lexicon.append("".join(rng.choice(cjk) for _ in range(rng.randint(1, 3))))
        else:
            w = "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
            lexicon.append(w.capitalize() if rng.random() < 0.1 else w)
    # Cumulative weights once: passing plain weights makes every choices() call re-sum them.
    cum, total = [], 0.0
    for i in range(len(lexicon)):
        total += 1.0 / (i + 1)
        cum.append(total)
    lines, size = [], 0
    while size < megabytes * (1 << 20):
        words = rng.choices(lexicon, cum_weights=cum, k=rng.randint(5, 25))
        line = " ".join(words) + rng.choice([".", ",", "!", "?", ";", ""])
        lines.append(line)
        size += len(line.encode("utf-8")) + 1
    return lines + source_lines()


def train_large(out_dir, vocab, megabytes):
    spec = importlib.util.spec_from_file_location(
        "train_tiny_tokenizer", REPO / "tools/tokenizer/train_tiny_tokenizer.py")
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = out_dir / "corpus.txt"
    corpus.write_text("\n".join(generated_corpus(megabytes)) + "\n", encoding="utf-8")
    # Same pre-tokenizer, decoder and added tokens as the bundled tokenizer; only the size differs.
    trainer.BASE_VOCAB_SIZE = vocab
    tok = trainer.build(corpus)
    tok.save(str(out_dir / "tokenizer.json"))
    print(f"wrote {out_dir / 'tokenizer.json'} ({tok.get_vocab_size()} tokens)", file=sys.stderr)


def bench(tokenizer_path, text_path, passes):
    from tokenizers import Tokenizer, __version__

    tok = Tokenizer.from_file(str(tokenizer_path))
    docs = [json.loads(l) for l in open(text_path, encoding="utf-8") if l.strip()]
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    rates, cpu_rates, tokens = [], [], 0
    for p in range(passes + 1):
        start, cpu_start = time.perf_counter(), time.process_time()
        tokens = 0
        for d in docs:
            tokens += len(tok.encode(d, add_special_tokens=False).ids)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        # Pass 0 warms the word cache, as the C++ serial benchmark's warm-up does.
        if p > 0:
            rates.append(nbytes / elapsed / 1e6)
            cpu_rates.append(nbytes / cpu / 1e6)
    print(json.dumps({
        "tokenizers": __version__,
        "tokenizer": str(tokenizer_path),
        "bytes": nbytes,
        "tokens_per_byte": tokens / nbytes,
        "passes_MBps": [round(r, 2) for r in rates],
        "median_MBps": round(statistics.median(rates), 2),
        # Per CPU second: less sensitive to a loaded machine than wall time.
        "median_cpu_MBps": round(statistics.median(cpu_rates), 2),
    }))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-text")
    m.add_argument("out")
    m.add_argument("--megabytes", type=float, default=4.0)
    t = sub.add_parser("train-large")
    t.add_argument("out_dir")
    t.add_argument("--vocab", type=int, default=100000)
    t.add_argument("--megabytes", type=float, default=40.0)
    b = sub.add_parser("bench")
    b.add_argument("--tokenizer", default=str(REPO / "examples/tiny/tokenizer/tokenizer.json"))
    b.add_argument("--text", required=True)
    b.add_argument("--passes", type=int, default=5)
    args = ap.parse_args()
    if args.cmd == "make-text":
        make_text(args.out, args.megabytes)
    elif args.cmd == "train-large":
        train_large(args.out_dir, args.vocab, args.megabytes)
    else:
        bench(args.tokenizer, args.text, args.passes)


if __name__ == "__main__":
    main()
