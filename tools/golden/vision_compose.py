#!/usr/bin/env python3
"""Golden fixture for the composed vision-language model (transformers 5.17.0
`Glm5NextForConditionalGeneration`, fp32, eager attention and experts): image and video features
spliced into the token embeddings, the LM loss and its gradients down into the vision tower.

The model is the text model of tests/golden/model/tiny_backward.safetensors (the same `glmtune
init` checkpoint, its redrawn parameters loaded) with the vision tower of
tests/golden/vision/tower.safetensors (the tiny preset's vision config), so this fixture stores no
parameter of its own.

Three documents, each run alone (batch of one) as the reference runs a sample:
  0  text only
  1  two images (grids (1, 2, 4) and (1, 2, 2): 2 and 1 <|image|> tokens), each wrapped in
     <|begin_of_image|> ... <|end_of_image|>
  2  a video of two tubelets (grid (2, 2, 2)): <|begin_of_video|>, per tubelet <|begin_of_image|>,
     one <|image|>, <|end_of_image|> and two timestamp tokens, <|end_of_video|>
Labels are the next token of the same document, ignored where that token is a media token (the
placeholders and their markers) and at the document's end. The loss is the token mean over all
documents (Σ_docs Σ CE / Σ_docs #labels); the backward accumulates over the documents.

Inputs are redrawn until no top-k choice of the text model (indexer pools, routers) is near a tie,
as in model_backward.py.

Tensors:
  input_ids int32 [T], cu_seqlens int32 [4], labels int32 [T], mm_token_type_ids int32 [T]
  (0 text, 1 image, 2 video), pixel_values f32 [12, 1176], image_grid_thw i64 [2, 3],
  pixel_values_videos f32 [8, 1176], video_grid_thw i64 [1, 3], doc_loss_sum f64 [3] (Σ CE per
  document), doc_tokens i64 [3], loss f64 [1], d_embeddings f32 [T, D] (the gradient of the
  spliced embeddings), grad.model.visual.<name> f32 (every tower and projector parameter).

Usage: python tools/golden/vision_compose.py GLMTUNE_BINARY   (a Python with transformers 5.17.0)
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_torch_fallback, tiny_reference  # noqa: E402
from model_forward import (  # noqa: E402  (shared helpers of the text fixtures)
    ROUTER_GAP,
    Capture,
    indexer_is_clear,
    released_name,
    router_gap,
)

REPO = Path(__file__).resolve().parents[2]
TEXT_FIXTURE = REPO / "tests" / "golden" / "model" / "tiny_backward.safetensors"
TOWER_FIXTURE = REPO / "tests" / "golden" / "vision" / "tower.safetensors"
OUT = REPO / "tests" / "golden" / "vision" / "compose.safetensors"
DRAW_SEED = 4242
IMAGE_GRIDS = [[1, 2, 4], [1, 2, 2]]
VIDEO_GRID = [2, 2, 2]


def load_model(glmtune, meta):
    model = tiny_reference(glmtune, meta["init_seed"], meta["init_sets"])
    # Parameters and buffers (the router correction bias) under their released names.
    state = {released_name(n): t for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    with torch.no_grad():
        for fixture in (TEXT_FIXTURE, TOWER_FIXTURE):
            with safe_open(str(fixture), "pt") as f:
                for key in f.keys():
                    if key.startswith("param."):
                        name = key[len("param."):]
                        assert name in state, f"{name} is not a tensor of the reference model"
                        state[name].copy_(f.get_tensor(key))
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("glmtune", help="path to the glmtune binary")
    args = parser.parse_args()
    require_torch_fallback()
    torch.set_num_threads(1)
    with safe_open(str(TEXT_FIXTURE), "pt") as f:
        meta = json.loads(f.metadata()["fixture"])
    model = load_model(args.glmtune, meta)
    model.train()
    cfg = model.config
    text = cfg.text_config
    vocab = text.vocab_size
    img, b_img, e_img = cfg.image_token_id, cfg.image_start_token_id, cfg.image_end_token_id
    b_vid, e_vid = cfg.video_start_token_id, cfg.video_end_token_id
    media = {img, b_img, e_img, b_vid, e_vid, cfg.video_token_id}
    lm = model.model.language_model
    dsa_layers = [i for i, t in enumerate(text.layer_types) if t == "deepseek_sparse_attention"]
    moe_layers = [i for i, t in enumerate(text.mlp_layer_types) if t == "sparse"]
    merge = model.model.visual.spatial_merge_size ** 2
    gen = torch.Generator().manual_seed(DRAW_SEED)

    def words(n):
        ids = torch.randint(0, vocab, (n,), generator=gen)
        for bad in media | {text.pad_token_id}:
            ids[ids == bad] = 1
        return ids.tolist()

    def layout():
        image_tokens = [t * h * w // merge for t, h, w in IMAGE_GRIDS]
        per_tubelet = VIDEO_GRID[1] * VIDEO_GRID[2] // merge
        doc0 = words(9)
        doc1 = words(2) + [b_img] + [img] * image_tokens[0] + [e_img] + words(3) + [b_img] + \
            [img] * image_tokens[1] + [e_img] + words(5)
        doc2 = words(2) + [b_vid]
        for _ in range(VIDEO_GRID[0]):
            doc2 += [b_img] + [img] * per_tubelet + [e_img] + words(2)
        doc2 += [e_vid] + words(4)
        return [doc0, doc1, doc2]

    image_rows = sum(t * h * w for t, h, w in IMAGE_GRIDS)
    video_rows = VIDEO_GRID[0] * VIDEO_GRID[1] * VIDEO_GRID[2]
    image_grid = torch.tensor(IMAGE_GRIDS, dtype=torch.int64)
    video_grid = torch.tensor([VIDEO_GRID], dtype=torch.int64)

    def run(d, ids, pixels, videos):
        kwargs = {"input_ids": torch.tensor([ids])}
        if d == 1:
            kwargs.update(pixel_values=pixels, image_grid_thw=image_grid)
        if d == 2:
            kwargs.update(pixel_values_videos=videos, video_grid_thw=video_grid)
        return model(**kwargs)

    cap = Capture(model)
    for draw in range(2000):
        docs = layout()
        pixels = torch.randn((image_rows, 1176), generator=gen)
        videos = torch.randn((video_rows, 1176), generator=gen)
        clear = True
        with torch.no_grad():
            for d, ids in enumerate(docs):
                cap.reset()
                run(d, ids, pixels, videos)
                for i in dsa_layers:
                    x, q_resid = cap.indexer_in[i]
                    clear &= indexer_is_clear(lm.layers[i].self_attn.indexer, x, q_resid,
                                              text.index_kpool, text.index_topk)
                for i in moe_layers:
                    clear &= router_gap(lm.layers[i].mlp.gate, cap.router_in[i])[1] > ROUTER_GAP
        if clear:
            break
    else:
        raise RuntimeError("no tie-free draw")
    for h in cap.handles:
        h.remove()

    labels = []
    for ids in docs:
        nxt = ids[1:] + [-100]
        labels.append([t if t not in media else -100 for t in nxt])
    total = sum(sum(1 for t in lab if t != -100) for lab in labels)

    spliced = []

    def capture_splice(module, args, kwargs):  # the text model's input: the spliced embeddings
        e = kwargs["inputs_embeds"]
        e.retain_grad()
        spliced.append(e)

    handle = lm.register_forward_pre_hook(capture_splice, with_kwargs=True)
    model.zero_grad(set_to_none=True)
    doc_sums = []
    for d, (ids, lab) in enumerate(zip(docs, labels)):
        logits = run(d, ids, pixels, videos).logits[0].float()
        doc_sum = F.cross_entropy(logits, torch.tensor(lab), ignore_index=-100, reduction="sum")
        (doc_sum / total).backward()
        doc_sums.append(doc_sum.item())
    handle.remove()

    mm_types = []  # the processor's rule: <|image|> inside a video span is a video token
    for ids in docs:
        depth = 0
        for t in ids:
            depth += t == b_vid
            mm_types.append(0 if t != img else (2 if depth > 0 else 1))
            depth -= t == e_vid
    tensors = {
        "input_ids": torch.tensor(sum(docs, []), dtype=torch.int32),
        "cu_seqlens": torch.tensor([0] + list(torch.tensor([len(d) for d in docs]).cumsum(0)), dtype=torch.int32),
        "labels": torch.tensor(sum(labels, []), dtype=torch.int32),
        "mm_token_type_ids": torch.tensor(mm_types, dtype=torch.int32),
        "pixel_values": pixels,
        "image_grid_thw": image_grid,
        "pixel_values_videos": videos,
        "video_grid_thw": video_grid,
        "doc_loss_sum": torch.tensor(doc_sums, dtype=torch.float64),
        "doc_tokens": torch.tensor([sum(1 for t in lab if t != -100) for lab in labels], dtype=torch.int64),
        "loss": torch.tensor([sum(doc_sums) / total], dtype=torch.float64),
        "d_embeddings": torch.cat([e.grad[0] for e in spliced]),
    }
    for name, p in model.model.visual.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        tensors["grad.model.visual." + name] = p.grad
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT), metadata={"draws": str(draw + 1)})
    size = OUT.stat().st_size
    assert size < 600_000, f"fixture is {size} bytes"
    print(f"{OUT.name}: {size} bytes, loss {sum(doc_sums) / total:.6f}, per document {doc_sums}, "
          f"{draw + 1} draws")


if __name__ == "__main__":
    main()
