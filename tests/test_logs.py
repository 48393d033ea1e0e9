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
