"""tiny-vlm accuracy on held-out easy-VQA test questions: one image, and one named image among 2, 4 or 8.

Exact match of the greedy answer, computed in one batched teacher-forced pass: greedy decoding
produces the target answer exactly when, at every answer position, the target token (and finally
the end-of-turn token) is the argmax. Contexts with several images are prefilled once and their
questions batched over copies of that cache.
"""

import random
from collections import defaultdict

import torch
from tqdm import tqdm
from transformers import DynamicCache

from .data import answer_type, group_by_image, named, questions
from .episodes import IGNORE, pad_batch


@torch.inference_mode()
def _correct(vlm, embeds, targets, mask, cache=None) -> list[bool]:
    """Per row: is every answer token the argmax at its position?"""
    if cache is not None:
        prefix = cache.get_seq_length()
        mask = torch.cat([mask.new_ones(mask.shape[0], prefix), mask], dim=1)
    hidden = vlm.model.model(inputs_embeds=embeds, attention_mask=mask, past_key_values=cache,
                             use_cache=cache is not None).last_hidden_state
    keep = targets != IGNORE
    hits = vlm.model.lm_head(hidden[keep]).argmax(-1) == targets[keep]
    rows = keep.nonzero()[:, 0]
    wrong = torch.zeros(len(targets), dtype=torch.long, device=rows.device).index_add_(0, rows, (~hits).long())
    return (wrong == 0).tolist()


def _answered(vlm, builder, rows, batch: int):
    """Rows (turns, tag) scored `batch` at a time: per batch, [(tag, right?)] in row order."""
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        items = builder.embed_batch([builder.pieces(turns) for turns, _ in chunk])
        yield [(tag, ok) for (_, tag), ok in zip(chunk, _correct(vlm, *pad_batch(items)), strict=True)]


def _question_part(builder, text, answer):
    """Embeddings and targets of one question turn with its answer, as appended after a context."""
    return builder.embed(builder.pieces([("ask", text, answer)])[1:])  # the context holds the system turn


def evaluate(vlm, builder, n: int = 1000, contexts=(2, 4, 8), seed: int = 0, batch: int = 32,
             progress: bool = True) -> dict:
    """{"all", "colour", "shape", "yes/no", "ctx2", ...: accuracy} over `n` questions per setting."""
    rng = random.Random(seed)
    test = questions("test")
    by_image = group_by_image(test)
    hits: dict[str, list[bool]] = defaultdict(list)
    bar = tqdm(total=n * (1 + len(contexts)), desc="tiny-vlm eval", unit="q", disable=not progress)
    single = rng.sample(test, n)  # one image in context, the question as asked in easy-VQA
    rows = [([("clip", q.image), ("ask", q.text, q.answer)], answer_type(q.answer)) for q in single]
    for scored in _answered(vlm, builder, rows, batch):
        for kind, ok in scored:
            hits["all"].append(ok)
            hits[kind].append(ok)
        bar.update(len(scored))
    for k in contexts:  # k images in context; each question names its clip
        done = 0
        while done < n:
            images = rng.sample(sorted(by_image), k)
            asked = []
            for _ in range(min(k, n - done)):
                j = rng.randrange(k)
                asked.append((j + 1, rng.choice(by_image[images[j]])))
            cache = DynamicCache()
            context, _ = builder.embed(builder.pieces([("clip", i) for i in images]))
            with torch.inference_mode():
                vlm.model.model(inputs_embeds=context[None], past_key_values=cache, use_cache=True)
                cache.batch_repeat_interleave(len(asked))
            items = [_question_part(builder, named(q, j), q.answer) for j, q in asked]
            hits[f"ctx{k}"] += _correct(vlm, *pad_batch(items), cache=cache)
            done += len(asked)
            bar.update(len(asked))
    bar.close()
    return {key: sum(v) / len(v) for key, v in hits.items()}


def evaluate_labels(vlm, builder, frames: dict[int, tuple], n: int = 300, contexts=(1, 8), seed: int = 1,
                    batch: int = 16, progress: bool = True) -> dict:
    """Questions answered from clip labels on held-out scene frames (`scenes.scene_frames("test")`, whose
    features `builder` must hold): {"labels_what", "labels_is", "labels_which": accuracy with one clip,
    "labels_ctxK": with K clips, the question naming one}. Three in four clips carry a random label set,
    the others their frame's own labels."""
    from .data import named_text
    from .scenes import label_question, random_labels

    rng = random.Random(seed)
    more = vlm.perception.more_words  # label sets and answers in the words its clip turns use
    hits: dict[str, list[bool]] = defaultdict(list)
    ids = sorted(frames)
    bar = tqdm(total=n * len(contexts), desc="tiny-vlm label eval", unit="q", disable=not progress)
    for k in contexts:
        rows = []
        for _ in range(n):
            content = []
            for _ in range(k):
                frame = rng.choice(ids)
                labels = random_labels(rng, more) if rng.random() < 0.75 else frames[frame]
                content.append((frame, vlm.fit_labels(labels)))  # what the turn holds
            j = rng.randrange(k)
            text, answer, kind = label_question(rng, content[j][1], more)
            turns = [("clip", f, labels) for f, labels in content]
            rows.append((turns + [("ask", text if k == 1 else named_text(text, j + 1), answer)], kind))
        for scored in _answered(vlm, builder, rows, batch):
            for kind, ok in scored:
                hits[f"labels_{kind}" if k == 1 else f"labels_ctx{k}"].append(ok)
            bar.update(len(scored))
    bar.close()
    return {key: sum(v) / len(v) for key, v in hits.items()}


def evaluate_distractors(vlm, builder, frames: dict[int, tuple], n: int = 300, clips: int = 4, seed: int = 2,
                         batch: int = 16, progress: bool = True) -> dict:
    """"is there X?" about one of `clips` held-out scene clips (the latest, unnamed, as the product asks
    about the present; or an earlier one, named), X held by another clip in context: {"distractor_no": X
    not in the asked clip, answer no; "distractor_yes": X in the asked clip and another one, answer yes}.
    The one label question whose right answer depends on which clip is asked about."""
    from .data import named_text
    from .labels import words_of
    from .scenes import article, distractor_word, random_labels

    rng = random.Random(seed)
    more = vlm.perception.more_words
    ids, rows = sorted(frames), []
    while len(rows) < n:
        content = [vlm.fit_labels(random_labels(rng, more)) for _ in range(clips)]
        j = clips - 1 if rng.random() < 0.5 else rng.randrange(clips - 1)
        others = content[:j] + content[j + 1:]
        if rng.random() < 0.5:
            word, answer, kind = distractor_word(rng, content[j], others, more), "no", "distractor_no"
        elif content[j]:  # the asked clip's thing, shown in another clip too
            thing, other = rng.choice(content[j]), rng.choice([i for i in range(clips) if i != j])
            content[other] = vlm.fit_labels((thing,) + tuple(i for i in content[other] if i != thing)[:2])
            word, answer, kind = rng.choice(sorted(words_of(thing, more))), "yes", "distractor_yes"
        else:
            word = None
        if word is None:
            continue
        text = f"is there {article(word)} {word}?"
        turns = [("clip", rng.choice(ids), labels) for labels in content]
        rows.append((turns + [("ask", text if j == clips - 1 else named_text(text, j + 1), answer)], kind))
    hits: dict[str, list[bool]] = defaultdict(list)
    for scored in tqdm(_answered(vlm, builder, rows, batch), total=-(-n // batch), desc="tiny-vlm distractor eval",
                       unit="batch", disable=not progress):
        for kind, ok in scored:
            hits[f"labels_{kind}"].append(ok)
    return {key: sum(v) / len(v) for key, v in hits.items()}


def evaluate_label_questions(vlm, builder, frames: dict[int, tuple], n: int = 300) -> dict:
    """Every measure of questions answered from clip labels: `evaluate_labels` and `evaluate_distractors`."""
    return evaluate_labels(vlm, builder, frames, n=n) | evaluate_distractors(vlm, builder, frames, n=n)
