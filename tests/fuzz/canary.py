"""A module nothing imports: if it is ever in sys.modules, a message type name imported it."""


class Boom:
    """A class a hostile type name points at."""

    def __init__(self) -> None:
        raise AssertionError("a message type name instantiated tests.fuzz.canary.Boom")
