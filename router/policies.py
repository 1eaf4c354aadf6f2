"""Dispatch policies: which endpoint of a pool serves the next request.

A policy is any object with `pick(endpoints, prompt_token_ids) -> Endpoint`; `endpoints`
is never empty (the registry only asks when some endpoint is routable). Load- and
prefix-aware policies plug in here by name.
"""

from __future__ import annotations

import itertools
from typing import Protocol, Sequence


class Policy(Protocol):
    def pick(self, endpoints: Sequence, prompt_token_ids: Sequence[int]): ...


class RoundRobin:
    """Each endpoint in turn, skipping none: the simplest fair spread."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, endpoints: Sequence, prompt_token_ids: Sequence[int]):
        return endpoints[next(self._counter) % len(endpoints)]


POLICIES = {"round_robin": RoundRobin}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
