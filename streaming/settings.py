"""A session's settings, their one home: each one's default, what it means and the bounds its value must keep to
work at all. The server's request model (`serve/schema.py`: pydantic, built from these fields, with the server's own
limits on top), `stream-qa`'s options and their checks (`add_options`, `problem`; its own defaults for a file's run
and its own limits), the app's controls and a session folder's settings all take them from here. Light: nothing
here loads torch, so `stream-qa` checks what it was given before the model loads."""

import argparse
import math
from dataclasses import dataclass, field, fields

from .errors import ConfigError, UserError, one_line

IDLE_CLOSE_S = 600.0  # a hosted session nothing touched for this long is closed (the app's and the server's --idle)


class BadInput(UserError):
    """Something the user chose or typed cannot work; the message is one line for the chat."""


def _field(default, description: str, part: str = "model", **bounds):
    """A setting's default, what it means, its bounds (pydantic's `Field` keywords: gt, ge, le, max_length,
    allow_inf_nan) and the part of a command's options it sits in (`part`: "source" or "model")."""
    return field(default=default, metadata={"description": description, "part": part, **bounds})


BOUNDS = ("gt", "ge", "le", "max_length", "allow_inf_nan")  # the metadata a setting's value is checked against


@dataclass(frozen=True)
class Settings:
    """A session's settings; a value out of its bounds is refused when the settings are made (`BadInput`)."""

    model: str = _field("tiny-vlm", "the model (a name of `python -m models`, or an added checkpoint)", max_length=200)
    policy: str = _field("inf_mllm+recall", "cache policy (python -m inf_mllm policies)", max_length=200)
    budget: str = _field("256", "KV budget: tokens per layer, or memory such as 512MB, or auto", max_length=32)
    bias: float | None = _field(None, "inf_mllm attention bias b", ge=0, allow_inf_nan=False)
    window: int | None = _field(None, "inf_mllm retrieval window l", ge=1)
    fps: float = _field(1.0, "frames sampled per second of video", "source", gt=0, allow_inf_nan=False)
    clip_seconds: float = _field(2.0, "video seconds per clip turn", "source", gt=0, allow_inf_nan=False)
    max_new_tokens: int = _field(16, "tokens an answer may take", ge=1)
    gate: bool = _field(True, "skip perception and the KV turn of a clip whose frames did not change", "source")

    def __post_init__(self):
        said = problem(self.__dict__)
        if said:
            raise BadInput(said)
        # the policy and the budget parsed once, here: every front end gets the same one line for either
        object.__setattr__(self, "_spec", self._parse_spec())
        object.__setattr__(self, "_budget", self._parse_budget())

    def spec(self):
        """The policy with the bias and window it takes (the page shows both fields for every policy)."""
        return self._spec

    def budget_value(self):
        """Tokens (int), a memory size ("64MB") or "auto"; None for the full cache."""
        return self._budget

    def _parse_spec(self):
        from inf_mllm.spec import PolicySpec

        try:
            spec = PolicySpec.parse(self.policy)
        except ValueError as err:
            raise BadInput(one_line(err)) from None
        given = {k: v for k, v in (("bias", self.bias), ("window", self.window)) if v is not None}
        if not given:  # nothing to check against the policy: torch stays unloaded (stream-qa checks before it loads)
            return spec
        from inf_mllm.policies import policy_options

        names = policy_options(spec)
        return spec.with_options(**{k: v for k, v in given.items() if k in names})

    def _parse_budget(self):
        from inf_mllm.spec import parse_budget

        if not self._spec.bounded:
            return None
        try:
            return parse_budget(self.budget)
        except ValueError as err:
            raise BadInput(one_line(err)) from None

    def as_dict(self) -> dict:
        """The settings by field name (what a session folder keeps; `Settings(**d)` makes them again)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def describe(self) -> str:
        spec = self.spec()
        budget = f"budget {self.budget}" if spec.bounded else "unbounded"
        extra = "".join(f", {k} {v}" for k, v in spec.options.items())
        return f"{self.model}, {self.policy}, {budget}{extra}"


def unknown_model(name: str, offered) -> str | None:
    """The one line for a model that is not offered (every front end says it so, each with its own status); None
    when it is."""
    return None if name in offered else f"unknown model {name[:80]!r}; available: {', '.join(offered)}"


def problem(values: dict, limits: dict | None = None, name=lambda key: key) -> str | None:
    """The first of `values` (settings by field name) out of its field's bounds, or of a product's own `limits`
    ({field: {"le": …}}), in one line naming it as `name(field)` does; None when all keep them."""
    for f in fields(Settings):
        value = values.get(f.name)
        if value is None:
            continue
        bounds = f.metadata | (limits or {}).get(f.name, {})
        if isinstance(value, str):
            if len(value) > bounds.get("max_length", math.inf):
                return f"{name(f.name)} is at most {bounds['max_length']} characters"
            continue
        finite = isinstance(value, int) or math.isfinite(value)
        if not (finite or bounds.get("allow_inf_nan", True)) or value <= bounds.get("gt", -math.inf) \
                or value < bounds.get("ge", -math.inf):
            return f"{name(f.name)} must be {_kind(f, bounds)}, got {value}"
        if value > bounds.get("le", math.inf):
            return f"{name(f.name)} is at most {bounds['le']:g}, got {value}"
    return None


def _kind(f, bounds: dict) -> str:
    if "gt" in bounds:
        return "a positive number" if bounds["gt"] == 0 else f"a number above {bounds['gt']:g}"
    if value_type(f) is int:
        return f"a whole number ≥ {bounds.get('ge', 0)}"
    return f"a finite number ≥ {bounds.get('ge', 0):g}"


def value_type(f) -> type:
    """A field's type without its None (`float | None` → float)."""
    return next((t for t in getattr(f.type, "__args__", (f.type,)) if t is not type(None)), f.type)


def check_options(args, names: tuple[str, ...], limits: dict | None = None) -> None:
    """A command's settings options (`names`), each within its field's bounds and the command's own `limits`: the
    first that is not, as a one-line `ConfigError` naming its option."""
    said = problem({k: getattr(args, k) for k in names}, limits, lambda key: "--" + key.replace("_", "-"))
    if said:
        raise ConfigError(said)


def folder_spec(spec, folder):
    """The policy a session runs with a session folder (`folder` not None): the folder's session is its store, so it
    recalls. Decided here alone (stream-qa's record of the policy, every opened stream)."""
    from inf_mllm.spec import Recall

    return spec.with_recall(Recall()) if folder is not None and spec.recall is None else spec


def settings_of(args, model: str) -> Settings:
    """A command's settings options (every field it has) as the session's `Settings`, for `model`."""
    return Settings(**{f.name: getattr(args, f.name) for f in fields(Settings) if hasattr(args, f.name)
                       and f.name != "model"}, model=model)


def option_names(*parts: str) -> tuple[str, ...]:
    """The settings a command takes as options (all but the model, which each command names its own way), of
    `parts` ("source", "model"; default both)."""
    return tuple(f.name for f in fields(Settings) if f.name != "model" and (not parts or f.metadata["part"] in parts))


def add_options(group, names: tuple[str, ...], defaults: dict | None = None) -> None:
    """`names` as command-line options (`clip_seconds` → `--clip-seconds`), each its field's type and meaning, and
    its default (`defaults`: a product's own)."""
    for f in fields(Settings):
        if f.name in names:
            default = (defaults or {}).get(f.name, f.default)
            shown = f" (default {default})" if default is not None else ""
            kind = {"action": argparse.BooleanOptionalAction} if value_type(f) is bool else {"type": value_type(f)}
            group.add_argument("--" + f.name.replace("_", "-"), **kind, default=default,
                               help=f.metadata["description"] + shown)

