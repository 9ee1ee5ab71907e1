"""The tool of the tiny-cpu-tools preset: integer addition, what the tiny model cannot do alone.

Referenced as `tools/calculator.py:add` (relative to the preset). It runs in kubealign's reward-function
worker (its sandbox and limits), from the source text embedded in the pipeline; its schema — what a chat
template would show the model — comes from the type hints and the docstring.
"""


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return int(a) + int(b)
