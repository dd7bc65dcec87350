"""The adapter protocol: what the streaming layer needs from a video LLM.

An adapter turns a clip (uint8 frames with timestamps) into visual embeddings in the LLM's input
space, and wraps them, and questions, into chat turns that a `StreamSession` appends. Each turn is
self-contained text of the model's own chat format, so turns can be appended, evicted around and
re-asked in any order. Answers end with the model's end-of-turn token, which the session holds back
and prepends to the next turn (see `StreamSession.generate`).
"""

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from inf_mllm.answer import Sampling
from inf_mllm.decoding import Phrases, vocabulary
from inf_mllm.session import StreamSession
from inf_mllm.side import why_not_packed
from inf_mllm.spec import PolicySpec

from .intent import Intent, Resolution, linking, log_answer, read, resolve
from .words import items


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    visual_tokens: int  # per clip, as encode_clip returns them
    dtype: str
    device: str
    context_length: int
    hidden_size: int


@dataclass
class EncodedClip:
    """A clip as encoding leaves it for the model thread: `visual`, its embeddings in the LLM's input space (or, for
    an adapter that finishes a clip on the model thread, its features), and `meta`, what encoding learned of it that
    the clip log and the span store keep (tiny-vlm: `seen`, the words of the labels its turn carries). Known when
    the clip is encoded, so nothing reads it back from the embeddings. `times`: the stream seconds of the frames
    encoded, for a model whose turn says or positions them (None: the adapter places its frames itself). `inject`:
    features the model adds inside its first decoder layers at the visual tokens (Qwen3-VL's DeepStack), else None."""

    visual: torch.Tensor
    meta: dict = field(default_factory=dict)
    times: list[float] | None = None
    inject: list[torch.Tensor] | None = None
    frame_boxes: tuple = ()  # (video time, the detector's boxes) of each frame, apart from `meta`: not logged


@dataclass
class Reading:
    """A question as every caller asks it (the engine and `VideoAdapter.ask`): what it asks for and the clips that
    answer it (`models.intent`), the text the model reads (`VideoAdapter.phrase`), what recall may link
    (`intent.linking`: exactly the resolved clips, none for the present), whether the question and its answer stay
    in the cache, and the answer when the clip log holds it (when / how often: no model needed)."""

    intent: Intent
    resolution: Resolution
    text: str
    named: Callable[[dict], bool] | None
    keep: bool
    direct: str | None


def clip_span(timestamps: Sequence[float]) -> tuple[float, float | None]:
    """(start, end) of a clip known by its frames' times: its last frame lasts as long as the median gap before it
    (one second for a single frame); (0, None) for no frames."""
    if not len(timestamps):
        return 0.0, None
    times = [float(t) for t in timestamps]
    step = float(np.median(np.diff(times))) if len(times) > 1 else 1.0
    return times[0], times[-1] + (step if step > 0 else 1.0)


def visual_of(clip: "EncodedClip | torch.Tensor") -> torch.Tensor:
    """The embeddings (or features) of an encoded clip, or the tensor a caller built by hand."""
    return clip.visual if isinstance(clip, EncodedClip) else clip


class VideoAdapter(ABC):
    """A video LLM seen as: frames → visual embeddings → turns for the core's session."""

    name: str = ""
    past_answers_stay: bool = True  # False: the engine's questions about a past clip leave with their answers
    detect: bool = True  # the object detector reads every clip's frames for the clip log (`see`); `--no-detect`
    copies_words: bool = False  # its "what" answers copy its turns' words: held to those of the clip asked about
    packs_side_questions: bool = False  # its watches' questions may share forwards (side.py; proven for tiny-vlm)
    model: torch.nn.Module
    tokenizer: object

    @abstractmethod
    def encode_clip(self, frames: np.ndarray, timestamps: Sequence[float]) -> torch.Tensor:
        """(T, H, W, 3) uint8 frames → (N, hidden) visual embeddings in the LLM's input space."""

    def encode(self, frames: np.ndarray, timestamps: Sequence[float]) -> EncodedClip:
        """The engine's ingest-thread half: pure (reads no state the model thread writes), so it
        may run ahead of the model. Its output goes to `append_clip`, on the model thread, in video
        order. Stateless adapters encode the whole clip here; stateful ones only extract features."""
        return EncodedClip(self.encode_clip(frames, timestamps))

    def see(self, frames: np.ndarray, timestamps: Sequence[float]) -> EncodedClip:
        """`encode`, and what the object detector found in the frames, whatever the model (issue 60): `objects`
        (word → count), `boxes` (the last frame's) and, where the encoding gave no words, `seen` (the things' words),
        so the clip log answers "did you see / when / how many" and recall links by words for every model. An
        encoding that ran the detector itself (tiny-vlm, whose turn carries the words) is left as it is."""
        encoded = self.encode(frames, timestamps)
        if self.detect and "objects" not in encoded.meta:
            from .detector import shared  # lazy: the TFLite runtime loads on the first clip

            objects = shared().clip(frames)
            encoded.meta.update(objects.meta(timestamps))
            encoded.frame_boxes = objects.frame_boxes(timestamps)
            encoded.meta.setdefault("seen", ", ".join(objects.counts) or "nothing recognised")
        return encoded

    def fork(self) -> "VideoAdapter":
        """An adapter for one more concurrent stream on the same weights (stateless: itself)."""
        return self

    def expect_frames(self, height: int, width: int) -> None:
        """The size of the frames a source will deliver, known before the first one: an adapter whose token counts
        depend on it (Qwen-VL's patches) counts from it at once (`turn_tokens`, `describe`); others ignore it."""
        return None

    @abstractmethod
    def system_text(self) -> str:
        """The text that opens a conversation."""

    def system_ids(self) -> torch.Tensor:
        """(1, L) token ids of the opening turn. The LLaMA ports override it to put BOS in as an id."""
        return self.text_ids(self.system_text())

    def bos_then(self, text: str) -> torch.Tensor:
        """BOS as an id, then `text` tokenised without special tokens: what `tokenizer(text)` gives in the
        originals' transformers 4.31, whatever the checkpoint's `legacy` flag (BOS written as text "<s>"
        is followed by "A" instead of "▁A" under transformers 5 when legacy is false or absent)."""
        ids = self.text_ids(text)
        bos = self.tokenizer.bos_token_id
        if bos is None:
            return ids
        return torch.cat([ids.new_tensor([[bos]]), ids], dim=1)

    @abstractmethod
    def clip_text(self, index: int, start_s: float) -> tuple[str, str]:
        """Text before and after the visual embeddings of clip `index` (1-based)."""

    @abstractmethod
    def question_text(self, question: str) -> str:
        """A question turn, ending where the model's answer starts."""

    @abstractmethod
    def describe(self) -> AdapterInfo:
        """Visual tokens per clip, dtype, device and context length."""

    # --- shared turn building -------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.model.device

    def text_ids(self, text: str) -> torch.Tensor:
        return self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids.to(self.device)

    def embed_text(self, text: str) -> torch.Tensor:
        return self.model.get_input_embeddings()(self.text_ids(text))[0]

    def clip_turn(self, visual: EncodedClip | torch.Tensor, index: int, start_s: float = 0.0) -> torch.Tensor:
        """(1, L, hidden) input embeddings: the clip's text with its visual embeddings in place."""
        before, after = self.clip_text(index, start_s)
        dtype = self.model.get_input_embeddings().weight.dtype
        parts = [self.embed_text(before), visual_of(visual).to(self.device, dtype), self.embed_text(after)]
        return torch.cat(parts)[None]

    def question_turn(self, question: str, session: StreamSession | None = None) -> torch.Tensor:
        """The question's ids where `session` stands (the same anywhere but for adapters whose turns follow the
        conversation so far, such as a template's separator after an answer)."""
        return self.text_ids(self.question_text(question))

    def turn_tokens(self) -> int:
        """Tokens one clip turn adds to the cache: its visual tokens and its text."""
        return self.describe().visual_tokens + len(self.text_ids("".join(self.clip_text(1, 0.0)))[0])

    def question_tokens(self, question: str) -> int:
        """Tokens `question` takes as a question turn."""
        return len(self.text_ids(self.question_text(question))[0])

    def new_session(self, policy: PolicySpec | str = "inf_mllm", budget=None, store=None, static: bool = True,
                    compile_decode: bool = False, opening: bool = True, **options) -> StreamSession:
        """`store`: the span store of a policy with recall (a `SpanStore` or a folder; a session folder's);
        `static`, `compile_decode`: how the session keeps K/V and decodes (see StreamSession); none of them a
        policy option. `opening=False`: nothing appended yet, for a caller that lays out the whole conversation."""
        session = StreamSession(self.model, self.tokenizer, policy, budget=budget, store=store, static=static,
                                compile_decode=compile_decode, **options)  # the session reads the policy, once
        ids = self.system_ids() if opening else None
        if ids is not None and ids.shape[-1]:
            session.append(ids, store=False)
        return session

    def clip_meta(self, clip: EncodedClip | torch.Tensor, index: int, start_s: float, end_s: float | None) -> dict:
        """What the engine's clip log and the span store keep of a clip: its index and video times, and what its
        encoding learned of it (`EncodedClip.meta`: tiny-vlm's `seen`, the words its turn holds)."""
        meta = {"clip": index, "start": round(start_s, 3), "end": round(end_s if end_s is not None else start_s, 3)}
        return meta | clip.meta if isinstance(clip, EncodedClip) else meta

    def append_clip(self, session: StreamSession, clip: EncodedClip | torch.Tensor, index: int, start_s: float = 0.0,
                    end_s: float | None = None) -> dict:
        """The model-thread half: put `encode`'s output into the session (here: as a clip turn); with
        recall the turn is stored under its `clip_meta`, which is returned."""
        meta = self.clip_meta(clip, index, start_s, end_s)
        self._latest()[session] = meta  # a session without recall keeps no log: its newest clip, for `answer_words`
        visual = visual_of(clip)
        before = self.text_ids(self.clip_text(index, start_s)[0]).shape[-1]  # where the visual tokens sit (VL-Cache)
        session.append(inputs_embeds=self.clip_turn(visual, index, start_s), meta=meta,
                       vision=(before, before + visual.shape[0]))
        return meta

    def read_question(self, text: str, log: list[dict], now: float, oracle=None) -> Reading:
        """How `text` is asked at video time `now`, given the clip log (every clip's meta, in order). `oracle`: a
        predicate naming the clips that truly answer it (the benchmarks' oracle mode), taken instead of the words'."""
        intent = read(text)
        resolution = resolve(intent, log, now)
        if oracle is not None:
            targets = [m for m in log if oracle(m)]
            focus = targets[-1] if targets and targets[-1] is not log[-1] else None
            resolution = Resolution(targets, focus, "oracle", resolution.hits)
        focus = resolution.focus
        return Reading(intent, resolution, self.phrase(intent, focus["clip"] if focus else None), linking(resolution),
                       focus is None or self.past_answers_stay, log_answer(intent, resolution))

    def phrase(self, intent, clip: int | None) -> str:
        """The question as this model should read it, given its `models.intent.Intent` and the clip the
        answer is about (None: the latest). Models that read plain words take it as asked."""
        return intent.text

    def add_clip(self, session: StreamSession, frames: np.ndarray, timestamps: Sequence[float], index: int) -> None:
        """Encode and append a clip whose frames were taken at `timestamps` (stream seconds, any spacing)."""
        visual = self.see(frames, timestamps)
        self.append_clip(session, visual, index, *clip_span(timestamps))

    def ask(self, session: StreamSession, question: str, max_new_tokens: int = 32, **kwargs) -> Iterator[str]:
        """Append the question (recalling the stored clips it needs) and stream the answer as text pieces.

        On a session with recall, a question given without `named` is read as the engine reads it
        (`read_question`, against the clips the store holds): it links exactly the clips its words resolve to
        (none for a question about the present), the model reads it as this adapter phrases it, and when or how
        often a thing was seen is answered from the clip log. A caller that resolved it already passes `named`."""
        if session.recall is not None and "named" not in kwargs:
            log = session.store.clips()
            reading = self.read_question(question, log, log[-1]["end"] if log else 0.0)
            if reading.direct is not None:
                return iter([reading.direct])
            question, kwargs["named"] = reading.text, reading.named
            kwargs.setdefault("keep", reading.keep)
        words = self.answer_words(session, question)
        session.append_question(self.question_turn(question, session), named=kwargs.pop("named", None),
                                oracle=kwargs.pop("oracle", None), keep=kwargs.pop("keep", True))
        if words and "constraint" not in kwargs:
            kwargs["constraint"] = Phrases(words, self._vocabulary(), kwargs.get("eos_token_id") or
                                           self.model.generation_config.eos_token_id, max_new_tokens, self._cost)
        return self.stream_answer(session, max_new_tokens, **kwargs)

    def yes_or_no(self, session: StreamSession, question: str, **kwargs) -> str:
        """A watch's side question about the clip just in: its answer held to "yes" or "no" (in the few tokens they
        take), and the question with its answer gone from the cache once answered (`forget_question`), so the cache,
        and what the stream answers later, are as they would be without the watch."""
        try:
            return self.answer(session, question, max_new_tokens=self._yes_no().budget, constraint=self._yes_no(),
                               keep=False, **kwargs)
        finally:
            session.forget_question()

    def yes_or_no_all(self, session: StreamSession, questions: list[str], **kwargs) -> list[str]:
        """Every watch's side question about the clip just in, answered as `yes_or_no` answers each: in shared
        forwards (`StreamSession.side_logits`) where each answer is one token and the session allows it, one after
        another otherwise. `kwargs` (recall's `named`) are for the latter: a shared forward links nothing."""
        if not self.packs_side_questions or self._yes_no().budget != 1 or why_not_packed(session) is not None:
            return [self.yes_or_no(session, question, **kwargs) for question in questions]
        logits = session.side_logits([self.question_turn(question, session) for question in questions])
        picked = [int(Sampling(constraint=self._yes_no()).pick(row[None])[0]) for row in logits]
        return [self.tokenizer.decode([token], skip_special_tokens=True).strip() for token in picked]

    def _yes_no(self) -> Phrases:
        """A fresh constraint to "yes" or "no" (it keeps the answer's text so far), in the fewest tokens they take."""
        phrases = ["yes", "no", "Yes", "No"]
        budget = max(self._cost(phrase) for phrase in phrases)
        return Phrases(phrases, self._vocabulary(), self.model.generation_config.eos_token_id, budget, self._cost)

    def answer_words(self, session: StreamSession, question: str) -> list[str] | None:
        """The words a "what" answer may name, for a model whose answers copy its turns' words (`copies_words`): those
        of the clips the question (as the model reads it, `phrase`) is about, each spelled as the clip holds it, so an
        answer can neither garble them nor name another clip's. Resolved against the clips the session's store holds;
        without recall, only a question about the present is held (to the newest clip: a past one may have left the
        cache, and what the model says of it is its own). None: the model's words are free."""
        if not self.copies_words or (intent := read(question)).kind != "what":
            return None
        if session.recall is not None:
            log = session.store.clips()
        else:
            log = [self._latest()[session]] if session in self._latest() and intent.when == "now" else []
        if not log:
            return None
        targets = resolve(intent, log, log[-1]["end"]).targets or ([log[-1]] if intent.when == "now" else [])
        return list(dict.fromkeys(w for meta in targets for w in items(meta.get("seen", "")))) or None

    def _latest(self) -> "weakref.WeakKeyDictionary":
        if "_newest" not in self.__dict__:
            self._newest = weakref.WeakKeyDictionary()
        return self._newest

    def _vocabulary(self):
        if "_vocab" not in self.__dict__:
            self._vocab = vocabulary(self.tokenizer)  # about a second, once
        return self._vocab

    def _cost(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def stream_answer(self, session: StreamSession, max_new_tokens: int = 32, **kwargs) -> Iterator[str]:
        ids: list[int] = []
        shown = ""
        for token in session.generate(max_new_tokens, **kwargs):
            ids.append(int(token[0]))
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            if len(text) > len(shown):
                yield text[len(shown):]
                shown = text

    def answer(self, session: StreamSession, question: str, **kwargs) -> str:
        return "".join(self.ask(session, question, **kwargs)).strip()
