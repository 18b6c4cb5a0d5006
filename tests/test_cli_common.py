"""The helpers every command line shares, on hand-made values: one-line errors and ranges."""

from __future__ import annotations

import argparse

import pytest

from gated_attention.cli_common import bounded, first_line, format_size, memory_size, parse_size, physical_memory


@pytest.mark.parametrize(
    "error, line",
    [(OSError("  no such repo\nTraceback and advice\n"), "no such repo"), (ValueError(""), "ValueError"),
     (KeyError("x"), "'x'"),
     # transformers' tokenizer loading: the first line alone ended mid-sentence
     (ValueError("Couldn't instantiate the backend tokenizer from one of: \n(1) a file, \n(2) a class. \nInstall x."),
      "Couldn't instantiate the backend tokenizer from one of: (1) a file, (2) a class. Install x.")],
    ids=["many-lines", "empty", "key-error", "a-list-follows"],
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


@pytest.mark.parametrize(
    "text, size",
    [("4GB", 4 * 10**9), ("512MiB", 512 * 2**20), ("1.5gb", 1_500_000_000), ("1000", 1000), ("2 KiB", 2048),
     ("7B", 7), (".5TB", 5 * 10**11)],
)
def test_parse_size_reads_decimal_and_binary_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GB", "4XB", "-1GB", "4 G B", "1e9", "nan"])
def test_parse_size_refuses_what_is_no_size(text):
    with pytest.raises(ValueError, match="expected a size such as 4GB or 512MiB"):
        parse_size(text)


def test_memory_size_is_above_zero_and_at_most_the_machines_memory():
    assert memory_size("1MiB") == 2**20
    with pytest.raises(argparse.ArgumentTypeError, match="expected a size above zero, got '0GB'"):
        memory_size("0GB")
    ram = physical_memory()
    assert ram is not None and ram > 2**30  # Linux says
    with pytest.raises(argparse.ArgumentTypeError, match="more than this machine's memory"):
        memory_size(str(ram + 1))
    assert memory_size(str(ram)) == ram
    assert parse_size("9" * 400 + "GB") > ram  # exact decimals: no float to overflow
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'99999999999999999999'\.\.\. \(400 characters\) is more than"):
        memory_size("9" * 400)


@pytest.mark.parametrize("size, text", [(999, "999 B"), (1000, "1.00 KB"), (1_500_000_000, "1.50 GB"), (2 * 10**12, "2.00 TB")])
def test_format_size(size, text):
    assert format_size(size) == text
