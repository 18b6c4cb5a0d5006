"""The error of `convert`, `extend` and `export` for bad input, in a module that imports nothing heavy."""


class ConversionError(ValueError):
    """Bad input for convert / extend / export; the message is one readable line."""
