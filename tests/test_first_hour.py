"""What a newcomer met in their first hour with `stream-qa` and the soak, each checked where they met it: a budget
no clip fits refused before the model loads, a trailing "@word" that is no time refused, questions piped on stdin
asked in place of the sample ones, a soak too short to tell said INCONCLUSIVE (its own exit code), the options'
help. Nothing here loads a model: a test fails if one would (`load_adapter` raises)."""

import os

import pytest

import models
from models import ADAPTERS
from streaming import budgets
from streaming.cli import DEFAULT_QUESTIONS, build_parser, main, questions_from
from streaming.errors import EXIT_SOAK_FAILED, EXIT_SOAK_INCONCLUSIVE
from streaming.questions import QuestionError, parse_ask
from streaming.soak import GOAL_SLOPE_MB_PER_ROUND, QUESTION, judged


@pytest.fixture
def no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_adapter", refuse)


def test_a_budget_no_clip_turn_fits_is_refused_before_the_model_loads(no_model, capsys):
    assert main(["--budget", "1", "--fast"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["stream-qa: budget of 1 token per layer cannot hold one clip turn and a question of tiny-vlm "
                   "(60 tokens): raise --budget"]


def test_the_least_budgets_the_registry_keeps_are_the_loaded_models_floors(vlm):
    """The number `stream-qa` checks before loading is the one the loaded model's own check uses."""
    assert ADAPTERS["tiny-vlm"].least_budget == budgets.floor(vlm)


def test_a_trailing_word_after_an_at_sign_is_refused_and_a_spaced_at_sign_is_kept():
    with pytest.raises(QuestionError, match=r"@banana is not a video time"):
        parse_ask("what is it? @banana")
    assert parse_ask("what is it? @1m30s").at == 90.0
    assert parse_ask("who stands @ the door?").text == "who stands @ the door?"
    assert parse_ask("is bob@example.com on screen?").at is None


def test_questions_piped_on_stdin_replace_the_sample_ones(monkeypatch):
    args = build_parser().parse_args(["--fast"])
    args.video = args.webcam = args.url = None  # no source named, as `stream-qa` reads it
    read, write = os.pipe()
    with os.fdopen(read) as stdin:
        monkeypatch.setattr("sys.stdin", stdin)
        assert questions_from(args, 10.0) == ([], True)  # stdin is the source of questions
    os.close(write)
    monkeypatch.setattr("sys.stdin", open(os.devnull))  # nothing piped: the sample questions
    qs, from_stdin = questions_from(args, 10.0)
    assert not from_stdin and [q.text for q in qs] == [parse_ask(d).text for d in DEFAULT_QUESTIONS]


def verdict(**changes) -> dict:
    v = {"kv_within_bound": True, "oom_events": [], "answers": 5, "expected_answers": 5, "empty_answers": 0,
         "rss_slope_mb_per_round": 0.0, "rss_slope_ci95_mb_per_round": 0.001}
    return v | changes


def test_a_soak_too_short_to_tell_is_inconclusive_not_failed():
    goal = GOAL_SLOPE_MB_PER_ROUND
    assert judged(verdict()) == "PASS"
    assert judged(verdict(rss_slope_mb_per_round=-0.3, rss_slope_ci95_mb_per_round=2.0)) == "PASS"  # it fell
    assert judged(verdict(rss_slope_mb_per_round=0.3, rss_slope_ci95_mb_per_round=2.0)) == "INCONCLUSIVE"
    assert judged(verdict(rss_slope_mb_per_round=0.3, rss_slope_ci95_mb_per_round=float("nan"))) == "INCONCLUSIVE"
    assert judged(verdict(rss_slope_mb_per_round=10 * goal, rss_slope_ci95_mb_per_round=goal / 2)) == "FAIL"
    assert judged(verdict(rss_slope_mb_per_round=0.3, rss_slope_ci95_mb_per_round=2.0, answers=4)) == "FAIL"
    assert (EXIT_SOAK_FAILED, EXIT_SOAK_INCONCLUSIVE) == (3, 4)


def test_the_options_a_newcomer_asked_about_say_what_they_do():
    help_text = " ".join(build_parser().format_help().split())
    assert "--device DEVICE where the model runs" in help_text and "4 INCONCLUSIVE" in help_text
    assert f'"{QUESTION}" every 10 clips' in help_text and "-v, --verbose" in help_text
    from jetson.__main__ import build_parser as jetson_parser

    assert "OMP_WAIT_POLICY" in " ".join(jetson_parser().format_help().split())
