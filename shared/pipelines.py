"""Roles, pipelines and handoffs: the one home of their names and what each means.

Roles (`Role`): the three kinds of engine instance, `prefill`, `rld` (the relay-decode) and `md`
(main-decode). A StrEnum, so a role equals its name: configs (YAML), messages (msgpack), JSON
output, NATS users and subjects carry the plain string.

    p-md       prefill -> main-decode            high prefix hit: little KV crosses the WAN
    p-rld-md   prefill -> relay -> main-decode   the relay streams while main-decode's KV is on
                                                 the WAN, then hands over by token ids
    p-rld      prefill -> relay                  anomalous traffic (long input, short output),
                                                 or no main-decode reachable: never crosses
Handoffs (p-rld-md only): `oneshot` hands every token at once; `catchup` hands chunks while the
relay keeps streaming, until the gap is small.

The gateway validates overrides with these, the scheduler plans with them, prefill and the
decoders follow them, and the benchmarks and simulator name their modes with them.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    PREFILL = "prefill"
    RLD = "rld"
    MD = "md"


class Pipeline(StrEnum):
    P_MD = "p-md"
    P_RLD_MD = "p-rld-md"
    P_RLD = "p-rld"


class Handoff(StrEnum):
    NONE = "none"
    ONESHOT = "oneshot"
    CATCHUP = "catchup"


ROLES: tuple[str, ...] = tuple(r.value for r in Role)  # `name in ROLES`: Python 3.11's `in Role` refuses a str
PIPELINES: tuple[str, ...] = tuple(p.value for p in Pipeline)
HANDOFFS: tuple[str, ...] = (Handoff.ONESHOT.value, Handoff.CATCHUP.value)  # what a request may ask for

# The roles each pipeline runs on, in the order a request flows through them.
ROLES_OF: dict[str, tuple[Role, ...]] = {
    Pipeline.P_MD: (Role.PREFILL, Role.MD),
    Pipeline.P_RLD_MD: (Role.PREFILL, Role.RLD, Role.MD),
    Pipeline.P_RLD: (Role.PREFILL, Role.RLD),
}


def decoders_of(pipeline: str) -> tuple[Role, ...]:
    """The decode roles of a pipeline (what prefill pushes KV to)."""
    return ROLES_OF[pipeline][1:]


def first_decoder(pipeline: str) -> Role:
    """The role that streams the first tokens to the user."""
    return ROLES_OF[pipeline][1]


def hands_off(pipeline: str) -> bool:
    """Whether a relay hands this pipeline's requests to main-decode (by token ids)."""
    return pipeline == Pipeline.P_RLD_MD


def parse_pipeline(name: str) -> Pipeline:
    """The pipeline called `name`; ValueError naming the choices otherwise."""
    try:
        return Pipeline(name)
    except ValueError:
        raise ValueError(f"unknown pipeline {name!r}; one of {', '.join(PIPELINES)}") from None


def parse_handoff(name: str) -> Handoff:
    if name not in HANDOFFS:
        raise ValueError(f"unknown handoff {name!r}; one of {', '.join(HANDOFFS)}")
    return Handoff(name)
