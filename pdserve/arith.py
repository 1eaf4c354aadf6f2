"""Integer arithmetic every layer shares. The lowest layer of `pdserve`: it imports nothing,
so engine, kvtransfer, models and proto (which may not import each other) can all use it."""


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up, for b > 0: how many pages of `b` tokens hold `a` tokens. Exact at
    any size (`math.ceil(a / b)` goes through a float, wrong past 2**53); works as well on
    numpy and torch integer arrays."""
    return -(-a // b)
