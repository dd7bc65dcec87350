"""A clip's words, as the clip log keeps them (`seen`: "Egyptian Mau (cat), tabby cat, car"; `objects`: the
detector's word → count): whether they name a thing, how many of it a clip holds, and the items they list. Apart from
the question reader (`intent.py`) because an answer checks its words against the same items (`VideoAdapter.ask`)."""

import re
from functools import lru_cache


def singular(word: str) -> list[str]:
    """The word and the forms it may have in the singular ("buses" → "buse", "bus")."""
    out = [word]
    if word.endswith("ies") and len(word) > 4:
        out.append(word[:-3] + "y")
    if word.endswith("es") and len(word) > 3:
        out.append(word[:-2])
    if word.endswith("s") and not word.endswith("ss") and len(word) > 3:
        out.append(word[:-1])
    return out


def sees(meta: dict, thing: str) -> bool:
    """Whether a clip's `seen` words name `thing` (a whole word, singular or plural)."""
    seen = meta.get("seen", "").lower()
    return any(re.search(rf"(?<![\w-]){re.escape(w)}(?![\w-])", seen) for w in singular(thing))


def tally(meta: dict, word: str) -> int:
    """How many of `word` a clip holds: the clip's vote (`objects`), or, where the vote kept none but the clip's words
    name the thing (a person the classifier named, found by the detector in a frame or two short of the vote), the
    boxes of its last frame."""
    n = meta.get("objects", {}).get(word, 0)
    if n or not sees(meta, word):
        return n
    return sum(box.get("word") == word for box in meta.get("boxes", ()))


@lru_cache(maxsize=1)
def counted() -> frozenset[str]:
    """The words an object detector counts (COCO's and Open Images' everyday names, as `models.detector` and
    tiny-vlm's `labels.OBJECTS` say them; kept here so the core needs no model package: a test holds them equal)."""
    return frozenset("""person bicycle car motorcycle airplane bus train truck boat bench bird cat dog horse sheep cow
        elephant bear zebra giraffe backpack umbrella handbag tie suitcase frisbee skis snowboard ball kite skateboard
        surfboard bottle cup fork knife spoon bowl banana apple sandwich orange broccoli carrot pizza donut cake chair
        couch plant bed table toilet tv laptop remote keyboard phone microwave oven toaster sink refrigerator book
        clock vase scissors toothbrush vehicle desk monitor box camera mug""".split())


def items(seen: str) -> list[str]:
    """The things a clip's words list, each as the clip spells it ("Egyptian Mau (cat)", "tabby cat"); none for a clip
    that recognised nothing."""
    return [item for item in dict.fromkeys(part.strip() for part in seen.split(",")) if item]
