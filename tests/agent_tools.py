"""Tools and environments the tool tests name as module:function (tests/test_tools.py, tests/test_agent.py, the
launch tests with tools): one module, so that a name and the object resolve to the same function."""


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def no_docstring(a: int) -> int:
    return a


def no_hints(a):
    """Return a.

    Args:
        a: anything
    """
    return a


class Calculator:
    """An environment: reset with a row's numbers, calc() its tool, get_reward() its reward."""

    def reset(self, a, b, **row):
        self.a, self.b, self.called = a, b, False

    def calc(self) -> str:
        """The product of the question's numbers."""
        self.called = True
        return str(self.a * self.b)

    def get_reward(self) -> float:
        return float(self.called)


class NoReset:
    def calc(self) -> str:
        """The answer."""
        return "1"
