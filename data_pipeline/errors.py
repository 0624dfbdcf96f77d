"""The data pipeline's error types, below every module that raises them."""


class DataError(ValueError):
    """Bad input to the data pipeline; the message is one line naming the cause."""


class DataWorkerError(RuntimeError):
    """A DataLoader worker failed other than on bad data: an unexpected exception in it, or it
    died (killed by a signal); the message is one line naming the cause."""
