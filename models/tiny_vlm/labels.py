"""What EfficientNet-Lite0's own ImageNet head recognises in a clip, as words for the clip's turn.

The frozen encoder is an ImageNet classifier: its head names 1,000 real things. A clip's labels are
the top classes of each of its frames whose probability passes `THRESHOLD`, merged over the frames
(highest probability first, each class once, at most `MAX_LABELS`). They go into the clip turn as
text ("Seen: Egyptian Mau (cat), espresso (coffee)."), so they sit in the KV cache with the clip and
every eviction policy treats them as part of it. A class gets an everyday word beside its ImageNet
name ("mountain bike (bicycle)") when it has one here, so "is there a bicycle?" can be answered
from the text. `perception.py` may add more everyday words (`more_words`) and `PERSON`, a label that is
no ImageNet class.

`imagenet_classes.txt` holds the 1,000 class names in the classifier's output order (the short
names torchvision uses; copied from Gradio's bundled `media_assets/data/imagenet_labels.json`,
Apache-2.0).
"""

import re
from functools import cache, lru_cache
from pathlib import Path

import torch

THRESHOLD = 0.1  # a frame's class probability must reach this to be named
PER_FRAME = 3  # classes looked at per frame
MAX_LABELS = 3  # classes named per clip
NOTHING = "nothing recognised"
PERSON = 1000  # not an ImageNet class (ImageNet has none for people): "person", inferred by `perception.py`
# things the object detector names (`models.detector.WORDS`): label ids after PERSON, each its own everyday word
OBJECTS = ("bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light", "fire hydrant",
           "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow", "elephant", "bear",
           "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard",
           "ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
           "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange", "broccoli",
           "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch", "plant", "bed", "table", "toilet", "tv",
           "laptop", "computer mouse", "remote", "keyboard", "phone", "microwave", "oven", "toaster", "sink",
           "refrigerator", "book", "clock", "vase", "scissors", "teddy bear", "hair dryer", "toothbrush",  # COCO's 79
           "vehicle", "desk", "monitor", "box", "camera", "mug")  # and Open Images' others (Objectron's detector)
FIRST_OBJECT = PERSON + 1


def object_label(word: str) -> int | None:
    """The label id of a word the detector says ("person" → `PERSON`), None for a word outside `OBJECTS`."""
    if word == "person":
        return PERSON
    return FIRST_OBJECT + OBJECTS.index(word) if word in OBJECTS else None


def object_word(i: int) -> str | None:
    """The word of a detector label id (`PERSON` included), None for an ImageNet class."""
    if i == PERSON:
        return "person"
    return OBJECTS[i - FIRST_OBJECT] if FIRST_OBJECT <= i < FIRST_OBJECT + len(OBJECTS) else None


def all_labels(more: bool = False) -> tuple[int, ...]:
    """Every label id a clip turn may carry: ImageNet's, and with `more` PERSON and the detector's."""
    return (*range(len(names())), PERSON, *range(FIRST_OBJECT, FIRST_OBJECT + len(OBJECTS))) if more \
        else tuple(range(len(names())))


@lru_cache(maxsize=1)
def names() -> tuple[str, ...]:
    rows = (Path(__file__).parent / "imagenet_classes.txt").read_text().splitlines()
    assert len(rows) == 1000, len(rows)
    return tuple(rows)


def _ids(*items) -> set[int]:
    """Class ids from names and (first, last) ranges; an unknown name is a bug in the tables below."""
    index = {n: i for i, n in enumerate(names())}
    out: set[int] = set()
    for item in items:
        if isinstance(item, tuple):
            out.update(range(item[0], item[1] + 1))
        else:
            out.add(index[item])
    return out


@lru_cache(maxsize=1)
def general_words() -> dict[int, str]:
    """class id → the everyday word for it, where ImageNet's name is a breed, a model or a kind."""
    table = {
        "dog": _ids((151, 268)),
        "cat": _ids((281, 285)),
        "bird": _ids((7, 24), (80, 100), (127, 146)),
        "fish": _ids((0, 6), (389, 397)),
        "butterfly": _ids((321, 326)),
        "monkey": _ids((369, 384)),
        "bicycle": _ids("mountain bike", "tandem bicycle"),
        "car": _ids("station wagon", "taxicab", "convertible", "jeep", "limousine", "minivan", "Model T",
                    "race car", "sports car", "police van", "ambulance"),
        "truck": _ids("garbage truck", "pickup truck", "tow truck", "semi-trailer truck", "fire engine", "moving van"),
        "motorcycle": _ids("moped", "scooter"),
        "bus": _ids("minibus", "school bus", "trolleybus"),
        "boat": _ids("canoe", "catamaran", "fireboat", "gondola", "lifeboat", "motorboat", "trimaran", "yawl",
                     "schooner", "container ship", "ocean liner", "pirate ship"),
        "airplane": _ids("airliner", "military aircraft"),
        "train": _ids("high-speed train", "electric locomotive", "steam locomotive", "freight car"),
        "rocket": _ids("missile", "projectile", "space shuttle"),
        "camera": _ids("Polaroid camera", "reflex camera"),
        "clock": _ids("analog clock", "digital clock", "wall clock"),
        "coffee": _ids("espresso"),
        "cup": _ids("coffee mug", "measuring cup"),
        "fruit": _ids("Granny Smith", "strawberry", "orange", "lemon", "fig", "pineapple", "banana", "jackfruit",
                      "custard apple", "pomegranate"),
    }
    return {i: word for word, ids in table.items() for i in ids}


@lru_cache(maxsize=1)
def clothing() -> frozenset[int]:
    """Classes that are worn, or are people doing something: a frame that shows one almost always shows a
    person. Helmets are left out (one on a motorcycle seat is common); so are shoes and socks (a shop)."""
    return frozenset(_ids("abaya", "academic gown", "apron", "bikini", "bolo tie", "bow tie", "bulletproof vest",
                          "cardigan", "cloak", "cowboy hat", "fur coat", "gown", "hoop skirt", "jeans", "T-shirt",
                          "kimono", "lab coat", "military uniform", "miniskirt", "overskirt", "pajamas", "poncho",
                          "sarong", "sombrero", "suit", "sweatshirt", "swimsuit", "trench coat", "vestment",
                          "Windsor tie", "baseball player", "bridegroom", "scuba diver"))


@lru_cache(maxsize=1)
def more_words() -> dict[int, str]:
    """Everyday words that the issue-25 perception adds beside `general_words`. Kept apart because the
    default training draws its label sets from `general_words` (`TrainConfig.label_words` "tiles+person" adds these)."""
    table = {
        "bicycle": _ids("unicycle", "tricycle"),
        "rabbit": _ids("cottontail rabbit", "hare", "Angora rabbit"),
        "car": _ids("car wheel", "grille", "car mirror", "recreational vehicle", "go-kart", "golf cart"),
        "horse": _ids("common sorrel"),
        "fence": _ids("chain-link fence", "picket fence", "split-rail fence"),
        "person": clothing(),
    }
    return {i: word for word, ids in table.items() for i in ids}


def everyday(i: int, more: bool = False) -> str | None:
    """The everyday word for class `i` ("bicycle" for a mountain bike), with `more_words` when `more`."""
    if i >= PERSON:
        return object_word(i)
    word = general_words().get(i)
    return more_words().get(i) if word is None and more else word


@lru_cache(maxsize=1)
def categories() -> dict[str, frozenset[int]]:
    """What "what animal / vehicle / food did you see?" asks about."""
    general = general_words()
    vehicles = {i for i, w in general.items() if w in ("bicycle", "car", "truck", "motorcycle", "bus", "boat",
                                                        "airplane", "train")}
    return {"animal": frozenset(range(398)), "vehicle": frozenset(vehicles),
            "food": frozenset(_ids((924, 957), (959, 967), "cup") - _ids("cup"))}


def display(i: int, more: bool = False) -> str:
    """"mountain bike (bicycle)", or the bare name when its everyday word is already in it ("tabby cat")."""
    if i >= PERSON:
        return object_word(i)
    name, word = names()[i], everyday(i, more)
    if word is None or re.search(rf"\b{word}\b", name.lower()):
        return name
    return f"{name} ({word})"


def clip_labels(probs: torch.Tensor, threshold: float = THRESHOLD) -> tuple[int, ...]:
    """(T, 1000) class probabilities of a clip's frames → the class ids it names, most confident first."""
    probs = probs.float().reshape(-1, probs.shape[-1])
    top = probs.topk(PER_FRAME, dim=-1)
    best: dict[int, float] = {}
    for values, ids in zip(top.values.tolist(), top.indices.tolist(), strict=True):
        for p, i in zip(values, ids, strict=True):
            if p >= threshold and p > best.get(i, -1.0):
                best[i] = p
    return tuple(sorted(best, key=lambda i: -best[i])[:MAX_LABELS])


def listing(labels, more: bool = False) -> str:
    """What the clip's answer to "what is in the video?" says: its labels, or that nothing was recognised."""
    return ", ".join(display(i, more) for i in labels) if labels else NOTHING


def label_text(labels, more: bool = False) -> str:
    """The text that follows a clip's visual tokens in its turn (`more`: with `more_words`)."""
    return f" Seen: {listing(labels, more)}."


@cache
def words_of(i: int, more: bool = False) -> frozenset[str]:
    """The lower-case words a question or an answer may use for class `i`: its name and everyday word."""
    if i >= PERSON:
        return frozenset({object_word(i)})
    word = everyday(i, more)
    return frozenset({names()[i].lower()} | ({word} if word else set()))


def words_of_all(labels, more: bool = False) -> set[str]:
    """Every word a question or an answer may use for any of these labels."""
    return set().union(*(words_of(i, more) for i in labels)) if labels else set()


def mentioned(text: str, more: bool = False) -> set[int]:
    """Class ids whose name or everyday word `text` contains as whole words (lower case); with `more`,
    `more_words`, `PERSON` ("person") and the detector's words too."""
    text = text.lower()
    ids = all_labels(more)
    return {i for i in ids if any(_contains(text, w) for w in words_of(i, more))}


def _contains(text: str, word: str) -> bool:
    return word in text and re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def unsupported(answer: str, labels, more: bool = False) -> set[str]:
    """Thing names in `answer` (ImageNet names and everyday words) that the clip's labels do not back:
    neither one of their words nor a whole word inside one ("cat" in "tabby cat")."""
    allowed = words_of_all(labels, more)
    found = {w for i in mentioned(answer, more) for w in words_of(i, more) if _contains(answer.lower(), w)}
    return {w for w in found if w not in allowed and not any(_contains(a, w) for a in allowed)}
