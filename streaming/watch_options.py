"""`stream-qa`'s watch options: read and checked before the model loads, and what a run's watches and deliverers are
made of (`streaming/watches.py` holds the watches themselves; `webhooks.py` and `mqtt.py` deliver their alerts)."""

from .watches import COOLDOWN_S, REARM_CLIPS, Watcher, Watches, model_refusal, read_watches, session_watches


def add_watch_options(parser) -> None:
    """`stream-qa`'s watch options."""
    w = parser.add_argument_group("watches (standing conditions judged on every clip; an alert when one comes true)")
    w.add_argument("--watch", action="append", default=[], metavar="TEXT",
                   help='what to watch for, in plain words ("a person", "more than 2 cars", "the car leaves"; '
                        '"… @once": only the first time); may be repeated')
    w.add_argument("--watch-cooldown", type=float, default=COOLDOWN_S, metavar="S",
                   help=f"video seconds after an alert before the same watch fires again (default {COOLDOWN_S:g})")
    w.add_argument("--watch-rearm", type=int, default=REARM_CLIPS, metavar="N",
                   help=f"clips in a row without the condition before a watch fires again (default {REARM_CLIPS})")
    w.add_argument("--webhook", action="append", default=[], metavar="URL",
                   help="POST each alert here as JSON (at least once, its id as Idempotency-Key); may be repeated")
    w.add_argument("--mqtt", metavar="URL",
                   help="publish each alert to this MQTT broker, mqtt://[USER:PASSWORD@]HOST[:PORT][/PREFIX], with "
                        "Home Assistant's discovery (a binary sensor per watch)")
    w.add_argument("--snapshots", metavar="DIR",
                   help="write each alert's frame as DIR/ID.jpg (default: the session folder's alerts/, else none)")


def check_watches(args) -> list[Watcher]:
    """The run's watches, read before the model loads; ValueError in one line naming the option."""
    if args.watch_cooldown < 0 or args.watch_cooldown != args.watch_cooldown:
        raise ValueError(f"--watch-cooldown must be a number of seconds ≥ 0, got {args.watch_cooldown}")
    if args.watch_rearm < 1:
        raise ValueError(f"--watch-rearm must be a whole number ≥ 1, got {args.watch_rearm}")
    from .mqtt import Mqtt
    from .urls import LOCAL, UrlRefused
    from .webhooks import Webhooks

    for flag, given in (("--webhook", args.webhook), ("--mqtt", getattr(args, "mqtt", None))):
        if given and not args.watch:
            raise ValueError(f"{flag} sends alerts: give a --watch too")
    try:
        Webhooks.check(args.webhook, LOCAL)
    except UrlRefused as err:
        raise ValueError(f"--webhook: {err}") from None
    try:
        if getattr(args, "mqtt", None):
            Mqtt.check(args.mqtt, LOCAL)
    except UrlRefused as err:
        raise ValueError(f"--mqtt: {err}") from None
    try:
        watchers = Watches(read_watches(args.watch, args.watch_rearm, args.watch_cooldown), "")
        asks = any(w.watch.judged_by != "detector" for w in watchers.watchers)  # only then is the policy read here
        if asks and getattr(args, "policy", None) and (why := model_refusal(_policy_class(args.policy))):
            watchers.refuse_model(why)
        return watchers.watchers
    except ValueError as err:
        raise ValueError(f"--watch: {err}") from None


def _policy_class(text: str):
    from inf_mllm.policies import parts  # lazy: torch (the CLI checks its input before it loads)
    from inf_mllm.spec import as_spec

    return parts(as_spec(text))[0]


def watching(args, label: str, folder=None, through: int = 0) -> Watches | None:
    """`stream-qa`'s watches for one stream (None without any): `session_watches` of its options, named by its
    session folder or its source."""
    check_watches(args)
    watches = session_watches(folder.path.name if folder is not None else label, args.watch, folder, through,
                              args.watch_rearm, args.watch_cooldown, getattr(args, "snapshots", None))
    return watches if watches.watchers else None


def deliverers(args, watches=None) -> list:
    """`stream-qa`'s alert deliverers (`--webhook`, `--mqtt`; none without them): stream-qa's own URL rules (its
    user's machine: loopback and private addresses allowed), their failures one warning line each; the broker told
    of the stream's `watches` at once."""
    import sys

    from .urls import LOCAL

    def warn(text):
        print(f"warning: {text}", file=sys.stderr, flush=True)

    out = []
    if getattr(args, "webhook", None):
        from .webhooks import Webhooks

        out.append(Webhooks(args.webhook, LOCAL, warn=warn))
    if getattr(args, "mqtt", None):
        from .mqtt import Mqtt

        out.append(Mqtt(args.mqtt, LOCAL, warn=warn))
        if watches is not None:
            out[-1].announce(watches.session, watches.watchers)
    return out
