"""The originals' one-shot prompt: Vicuna v1 text with `<image>` slots, tokenised and embedded as they do it.

Chat-UniVi (`eval/model_video_qa.py`) and Flash-VStream (`serve/cli_video_stream.py`) both build
"{system} USER: <image>…\\n{question} ASSISTANT:" from the `v1` / `vicuna_v1` conversation and
tokenise it with `tokenizer_image_token` (mm_utils.py): the text is split at every `<image>`, each
piece tokenised on its own with BOS, BOS kept only on the first piece, and each `<image>` becomes
the id -200. Their `prepare_inputs_labels_for_multimodal*` then puts the visual embeddings where a
run of -200 ids stands (Chat-UniVi: one block per run of consecutive slots, one slot per frame;
Flash-VStream: the memory read-out in its single slot).

The product streams instead (a clip per user turn, answers kept: see ARCHITECTURE.md, "Where the
streaming prompt departs from the originals"); this module is the one-shot form, used by the
parity tests to feed our ports the originals' exact input and by anyone who wants their behaviour.
"""

import torch

IMAGE = "<image>"
IMAGE_INDEX = -200  # IMAGE_TOKEN_INDEX in both repositories' constants.py


def vicuna_v1(system: str, question: str, images: int = 1) -> str:
    """conv_v1 / conv_vicuna_v1 with one user message (`images` slots, then "\\n" and the question)."""
    return f"{system} USER: {IMAGE * images}\n{question} ASSISTANT:"


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """`tokenizer_image_token`: BOS as an id, each text piece tokenised without special tokens, -200 per slot.

    In transformers 4.31 `tokenizer(piece).input_ids` is BOS + the piece's pieces whatever the
    `legacy` flag; adding BOS as an id here gives the same ids under transformers 5.
    """
    ids = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    for i, piece in enumerate(prompt.split(IMAGE)):
        if i:
            ids.append(IMAGE_INDEX)
        ids += tokenizer(piece, add_special_tokens=False).input_ids
    return ids


def splice(embedding: torch.nn.Module, ids: list[int], visual: torch.Tensor) -> torch.Tensor:
    """(L, hidden) input embeddings: text ids embedded, each run of -200 ids replaced by `visual`."""
    ids_t = torch.tensor(ids)
    slot = ids_t == IMAGE_INDEX
    weight = embedding.weight
    parts, start = [], 0
    while start < len(ids):
        end = start
        while end < len(ids) and bool(slot[end]) == bool(slot[start]):
            end += 1
        if slot[start]:
            parts.append(visual.to(weight.device, weight.dtype))
        else:
            parts.append(embedding(ids_t[start:end].to(weight.device)))
        start = end
    return torch.cat(parts)
