"""The services' log set-up (specdec.telemetry.logs)."""

from __future__ import annotations

import logging

import pytest


@pytest.mark.parametrize(
    "value, level",
    [
        (None, logging.INFO),
        ("", logging.INFO),
        ("debug", logging.DEBUG),
        (" WARNING ", logging.WARNING),
        ("ERROR", logging.ERROR),
        ("verbose", None),
        ("10", None),
    ],
)
def test_the_log_level_comes_from_specdec_log_level(value, level):
    from specdec.telemetry.logs import level_from

    assert level_from(value) == level


def test_a_log_level_that_names_none_is_said_not_fatal(monkeypatch, caplog):
    from specdec.telemetry import logs

    monkeypatch.setenv(logs.LEVEL_ENV, "verbose")
    with caplog.at_level(logging.INFO):
        logs.configure("test")
    assert "SPECDEC_LOG_LEVEL='verbose' is not a log level (one of DEBUG, INFO, WARNING, ERROR)" in caplog.text


def test_debug_is_for_specdecs_own_loggers_not_the_libraries(monkeypatch):
    """At DEBUG, gRPC alone would log a line per call: the level applies to the specdec loggers."""
    from specdec.telemetry import logs

    monkeypatch.setenv(logs.LEVEL_ENV, "debug")
    ours, root = logging.getLogger("specdec"), logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # as in a fresh service process (pytest's restored after)
    monkeypatch.setattr(root, "level", root.level)
    try:
        logs.configure("test")
        assert logging.getLogger("specdec.loop.load_aware_k").isEnabledFor(logging.DEBUG)
        assert root.level == logging.INFO and not logging.getLogger("grpc._cython.cygrpc").isEnabledFor(logging.DEBUG)
    finally:
        ours.setLevel(logging.NOTSET)
