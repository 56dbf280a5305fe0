"""`glmtune eval` on a GPU and on the CPU against transformers 5.17.0 at full width.

Two steps, driven by tests/gpu/eval_reference.sh on a GPU machine:

  eval_reference.py samples --model DIR --out FILE.jsonl [--lengths 2400,600] [--seed N]
      pre-tokenised samples ({"input_ids": [...]}, every token scored) of random ids of the
      model's vocabulary (the padding id, whose embedding row is zero, left out)
  eval_reference.py compare --model DIR --samples FILE.jsonl --gpu GPU.json --gpu-logits GPU.st
                            --cpu CPU.json --cpu-logits CPU.st [--gpu-speed J --cpu-speed J]
                            [--out REPORT.json]
      runs each sample alone (a batch of one, no padding) through
      Glm5NextForConditionalGeneration in float32 with eager attention and experts on the GPU,
      and holds glmtune's results to it: the GPU evaluation's loss within 1e-2 relative and each
      document's logits ([length, vocab] as one tensor) within 3e-2 relative L2, the worst and
      median single position reported beside it; the CPU evaluation's loss within 1e-5 and its
      logits within 1e-4 of the reference's largest logit (docs/testing.md, "Parity measures").
      The speed runs (no logits dumped) give the tokens per second. Prints a table, writes the
      numbers to REPORT.json, exits 1 when a bar is missed.
"""
import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F
from safetensors import safe_open


def samples(args):
    config = json.load(open(f"{args.model}/config.json"))
    text = config.get("text_config", config)
    vocab, pad = text["vocab_size"], text.get("pad_token_id")
    gen = torch.Generator().manual_seed(args.seed)
    with open(args.out, "w") as f:
        for length in (int(x) for x in args.lengths.split(",")):
            ids = torch.randint(0, vocab, (length,), generator=gen)
            if pad is not None:
                ids[ids == pad] = (pad + 1) % vocab
            f.write(json.dumps({"input_ids": ids.tolist()}) + "\n")


def reference_logits(model_dir, documents):
    from transformers import Glm5NextForConditionalGeneration

    model = Glm5NextForConditionalGeneration.from_pretrained(
        model_dir,
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
    ).to("cuda")
    model.eval()
    out = []
    with torch.no_grad():
        for ids in documents:
            logits = model(input_ids=torch.tensor([ids], device="cuda")).logits[0]
            out.append(logits.float())
    return out


def document_loss(logits, ids):
    """Mean next-token cross-entropy over the document (every token scored, the last one has no
    target)."""
    target = torch.tensor(ids[1:], device=logits.device)
    return F.cross_entropy(logits[:-1].double(), target, reduction="mean").item(), len(ids) - 1


def compare(args):
    documents = [json.loads(line)["input_ids"] for line in open(args.samples) if line.strip()]
    reference = reference_logits(args.model, documents)
    ref_losses = [document_loss(l, ids) for l, ids in zip(reference, documents)]
    ref_total = sum(l * n for l, n in ref_losses) / sum(n for _, n in ref_losses)
    report = {"reference_loss": ref_total, "lengths": [len(d) for d in documents], "runs": {}}
    failed = []
    for name, result_file, logits_file, speed_file, loss_bar, relative_loss in (
        ("gpu", args.gpu, args.gpu_logits, args.gpu_speed, 1e-2, True),
        ("cpu", args.cpu, args.cpu_logits, args.cpu_speed, 1e-5, False),
    ):
        result = json.load(open(result_file))
        loss_err = abs(result["loss"] - ref_total) / (ref_total if relative_loss else 1.0)
        speed = json.load(open(speed_file)) if speed_file else result
        row = {
            "loss": result["loss"],
            "loss_error": loss_err,
            "tokens_per_second": speed["tokens_per_second"],
            "speed_tokens": speed["input_tokens"],
            "speed_seconds": speed["seconds"],
            "documents": [],
        }
        with safe_open(logits_file, "pt", device="cuda") as f:
            for i, (ref, ids) in enumerate(zip(reference, documents)):
                got = f.get_tensor(f"logits.{i}").float()
                per_position = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
                max_abs = ((got - ref).abs().max() / ref.abs().max()).item()
                doc = {
                    "length": len(ids),
                    "loss": result["per_sample"][i]["loss"],
                    "reference_loss": ref_losses[i][0],
                    "rel_l2": ((got - ref).norm() / ref.norm()).item(),
                    "worst_position_rel_l2": per_position.max().item(),
                    "median_position_rel_l2": per_position.median().item(),
                    "max_abs_over_max_ref": max_abs,
                }
                row["documents"].append(doc)
                if name == "gpu" and doc["rel_l2"] > 3e-2:
                    failed.append(f"gpu logits of document {i}: rel-L2 {doc['rel_l2']:.2e}")
                if name == "cpu" and max_abs > 1e-4:
                    failed.append(f"cpu logits of document {i}: {max_abs:.2e}")
        if loss_err > loss_bar:
            failed.append(f"{name} loss error {loss_err:.2e} over {loss_bar:g}")
        report["runs"][name] = row
    report["gpu_over_cpu_tokens_per_second"] = (
        report["runs"]["gpu"]["tokens_per_second"] / report["runs"]["cpu"]["tokens_per_second"]
    )
    print(f"reference loss (transformers 5.17.0, f32, GPU): {ref_total:.6f}")
    for name, row in report["runs"].items():
        print(
            f"{name}: loss {row['loss']:.6f} (error {row['loss_error']:.2e}), "
            f"{row['tokens_per_second']:.1f} tokens/s ({row['speed_tokens']} tokens in "
            f"{row['speed_seconds']:.2f} s)"
        )
        for i, d in enumerate(row["documents"]):
            print(
                f"  document {i} ({d['length']} tokens): loss {d['loss']:.6f} vs {d['reference_loss']:.6f}, "
                f"logits rel-L2 {d['rel_l2']:.2e} (per position: worst {d['worst_position_rel_l2']:.2e}, "
                f"median {d['median_position_rel_l2']:.2e}), max|diff|/max|ref| "
                f"{d['max_abs_over_max_ref']:.2e}"
            )
    print(f"gpu / cpu tokens/s: {report['gpu_over_cpu_tokens_per_second']:.1f}")
    report["failed"] = failed
    if args.out:
        json.dump(report, open(args.out, "w"), indent=1)
    for f in failed:
        print("FAILED:", f)
    return 1 if failed else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("samples")
    s.add_argument("--model", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--lengths", default="2400,600")
    s.add_argument("--seed", type=int, default=5)
    c = sub.add_parser("compare")
    for key in ("--model", "--samples", "--gpu", "--gpu-logits", "--cpu", "--cpu-logits"):
        c.add_argument(key, required=True)
    c.add_argument("--gpu-speed")
    c.add_argument("--cpu-speed")
    c.add_argument("--out")
    args = parser.parse_args()
    if args.cmd == "samples":
        samples(args)
        return 0
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
