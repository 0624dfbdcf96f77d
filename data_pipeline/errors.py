"""The data pipeline's one error type, below every module that raises it."""


class DataError(ValueError):
    """Bad input to the data pipeline; the message is one line naming the cause."""
