"""The one exception type users see: a message that says what is wrong and what to do."""


class SpecDecodeError(ValueError):
    """Bad input or an unusable model; the CLI prints it as one line and exits with code 2."""
