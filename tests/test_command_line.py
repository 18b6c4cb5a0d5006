"""The helpers every command line shares, on hand-made values: one-line errors and ranges."""

from __future__ import annotations

import argparse

import pytest

from gated_attention.hub.command_line import bounded, first_line


@pytest.mark.parametrize(
    "error, line",
    [(OSError("  no such repo\nTraceback and advice\n"), "no such repo"), (ValueError(""), "ValueError"),
     (KeyError("x"), "'x'")],
    ids=["many-lines", "empty", "key-error"],
)
def test_first_line(error, line):
    assert first_line(error) == line


@pytest.mark.parametrize(
    "parse, text, value",
    [(bounded(int, 1), "3", 3), (bounded(int, 0), "0", 0), (bounded(float, 0, strict=True), "1e-4", 1e-4),
     (bounded(float, 0, high=1), "0.5", 0.5)],
)
def test_bounded_accepts(parse, text, value):
    assert parse(text) == value


@pytest.mark.parametrize(
    "parse, text, message",
    [(bounded(int, 2), "1", "expected an integer >= 2, got '1'"),
     (bounded(int, 1), "1.5", "expected an integer >= 1, got '1.5'"),
     (bounded(float, 0, strict=True), "0", "expected a number > 0, got '0'"),
     (bounded(float, 0), "nan", "expected a number >= 0, got 'nan'"),
     (bounded(float, 0, high=1), "1", "expected a number >= 0 and < 1, got '1'")],
)
def test_bounded_refuses_naming_the_range(parse, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message.replace("(", r"\(")):
        parse(text)
