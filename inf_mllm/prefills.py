"""The pool's prefills (pool.py runs them in its round): clip turns of several streams packed into one forward,
and questions batched the same way once recall has linked what each needs.

Both keep what a lone session's `append` and `append_question` do, step for step (`begin_turn`, `turn_row`,
`turn_done`; `begin_question`, `question_done`); only the forward is shared: each row runs on its own cache
(rows.py), and a shared forward that fails is retried row by row, so one stream's fault stays its own.
"""

from .rows import forward_apart
from .work import ClipTurn, QuestionTurn


def clip_turns(model, turns: list[ClipTurn], end) -> None:
    """Clip turns in one forward, each on its own cache; then each is stored and evicts, as a lone session's
    `append` does. `end(session)` ends the stream's answer in progress first."""
    rows = []
    for turn in turns:
        end(turn.session)
        turn.session.begin_turn()
        rows.append(turn.session.turn_row(None, turn.embeds, turn.vision, turn.positions))
    sessions = [turn.session for turn in turns]
    starts = [session.clock() for session in sessions]
    for turn, row, t0, logits in zip(turns, rows, starts, forward(model, sessions, rows), strict=True):
        if isinstance(logits, BaseException):
            turn.fail(logits)
            continue
        session = turn.session
        try:
            kept = session.kept_inputs(row, turn.vision) if turn.store else {}
            session.turn_done(logits, row.length, t0, True, turn.store, turn.meta, **kept)
        except Exception as err:  # noqa: BLE001 (this stream's fault, handed to its caller)
            turn.fail(err)
            continue
        turn.finish(logits[:, None])


def questions(model, waiting: list[QuestionTurn], end) -> list:
    """Every waiting question: recall links what each needs (one stream at a time); one forward for all of them
    (a question that recomputes linked turns has one of its own); each reader gets its logits.
    Returns the sessions whose caches evict now, after every reader has its first token's logits."""
    together, alone = _link(waiting, end)
    for q, question in alone:
        _prefill_alone(q, question)
    rows = [q.session.turn_row(q.ids, None) for q, _ in together]
    starts = [q.session.clock() for q, _ in together]
    evicting = []
    sessions = [q.session for q, _ in together]
    for (q, question), row, t0, logits in zip(together, rows, starts, forward(model, sessions, rows), strict=True):
        if isinstance(logits, BaseException):
            q.fail(logits)
            continue
        q.session.turn_done(logits, row.length, t0, evict=False, store=False)
        q.session.question_done(question)
        q.finish(logits[:, None])
        if question.evict:
            evicting.append(q.session)
    return evicting


def forward(model, sessions: list, rows: list) -> list:
    """Each row's last logits (1, V), or the error its forward raised: one forward for all (rows.py); a lone row
    takes its session's own forward, so a pool of one runs a turn as a lone session does, bit for bit."""
    if len(rows) != 1:
        return forward_apart(model, rows)
    try:
        return [sessions[0].forward_row(rows[0]).logits[:, -1]]
    except Exception as err:  # noqa: BLE001 (this stream's fault, handed to its caller)
        return [err]


def _link(waiting: list[QuestionTurn], end) -> tuple[list, list]:
    """Each question begun (its stream's answer ended, recall's links made): those prefilled together, and those
    whose linked turns are recomputed with them."""
    begun = []
    for q in waiting:
        try:
            end(q.session)
            begun.append((q, q.session.begin_question(q.ids, **q.options)))
        except BaseException as err:  # noqa: BLE001 (handed to the question's caller)
            q.fail(err)
    return ([(q, question) for q, question in begun if question.recompute is None],
            [(q, question) for q, question in begun if question.recompute is not None])


def _prefill_alone(q: QuestionTurn, question) -> None:
    try:
        logits = q.session.prefill_recomputing(question, q.ids)
    except BaseException as err:  # noqa: BLE001 (handed to the question's caller)
        q.fail(err)
        return
    q.session.question_done(question)
    q.finish(logits)
