"""Enflame DRS profiles: how an Enflame card is shared, and which profile a pod gets.

Enflame's device plugin publishes, in the node annotation
``enflame.com/gcu-drs-capacity``, the node's cards (each with its capacity in
slices) and the DRS profiles a card can be cut into, by name
(``<slices>g.<memory>gb``, e.g. ``3g.20gb``) and ID. HAMi's scheduler gives a
container the profile of the slice count it asks for (``enflame.com/drs-gcu``),
or the smallest profile with at least the memory and cores it asks for
(``enflame.com/gcu-memory``, ``enflame.com/gcu-core``); the profile's memory and
its share of the card's compute (``ceil(slices * 100 / largest slices)`` percent)
are what the container holds.

A card's profiles and its device minor number travel with it as its model,
``DRS minor=<minor> <name>=<id> ...`` (:func:`model_of`, :func:`profiles_of`,
:func:`minor_of`), so that the scheduler chooses the profile on the node the
card is on and the bind writes the profile's name and ID and the card's minor.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Final

from gpuslice_common.models import MAX_NAME_LENGTH, DrsDemand

PREFIX: Final = "DRS"
MAX_PROFILES: Final = 16
MAX_SLICES: Final = 1024
MAX_MEMORY_GB: Final = 16 * 1024
_NAME: Final = re.compile(r"^([0-9]{1,4})g\.([0-9]{1,5})gb$")
_ID: Final = re.compile(r"^[A-Za-z0-9_.-]{1,16}$")


class ProfileError(ValueError):
    """A profile table cannot be used; the message names what is wrong."""


@dataclass(frozen=True, order=True)
class Profile:
    """One DRS profile: ``size`` slices and ``memory_gb`` GB of the card."""

    size: int
    memory_gb: int
    name: str
    id: str

    @property
    def memory_mib(self) -> int:
        return self.memory_gb * 1024


def profile(name: str, profile_id: str) -> Profile:
    """The profile ``name`` (``<slices>g.<memory>gb``, any case) of ID ``profile_id``;
    raises ProfileError naming what is wrong."""
    if not isinstance(name, str) or not isinstance(profile_id, str):
        raise ProfileError("a profile's name and ID are text")
    found = _NAME.fullmatch(name.strip().lower())
    if found is None:
        raise ProfileError(f"profile {name[:32]!r} is not <slices>g.<memory>gb")
    size, memory = int(found[1]), int(found[2])
    if not 1 <= size <= MAX_SLICES or not 1 <= memory <= MAX_MEMORY_GB:
        raise ProfileError(f"profile {name[:32]!r} is outside 1..{MAX_SLICES} slices")
    if not _ID.fullmatch(profile_id):
        raise ProfileError(f"profile {name[:32]!r} ID {profile_id[:32]!r} is not a short word")
    return Profile(size, memory, f"{size}g.{memory}gb", profile_id)


def table(profiles: list[Profile]) -> tuple[Profile, ...]:
    """``profiles`` sorted as HAMi tries them (slices, then memory); raises ProfileError
    for none, too many, one name twice, or two a grant cannot tell apart (the same
    memory and share of the card: the bind reads the profile back from the grant,
    :func:`granted`)."""
    if not profiles:
        raise ProfileError("it lists no profiles")
    if len(profiles) > MAX_PROFILES:
        raise ProfileError(f"it lists {len(profiles)} profiles, above {MAX_PROFILES}")
    if len({p.name for p in profiles}) != len(profiles):
        raise ProfileError("a profile is listed twice")
    found = tuple(sorted(profiles))
    grants: dict[tuple[int, int], Profile] = {}
    for p in found:
        share = cores(p, found)
        same = grants.setdefault((p.memory_gb, share), p)
        if same is not p:
            raise ProfileError(
                f"profiles {same.name} and {p.name} are both {p.memory_gb} GB and {share} % "
                "of the card: a grant of one cannot be told from the other"
            )
    return found


def largest(profiles: tuple[Profile, ...]) -> Profile:
    return max(profiles, key=lambda p: (p.size, p.memory_gb))


def cores(p: Profile, profiles: tuple[Profile, ...]) -> int:
    """The share of the card's compute a profile is, in percent (HAMi's rounding up)."""
    return math.ceil(p.size * 100 / largest(profiles).size)


_MINOR: Final = re.compile(r"^[0-9]{1,6}$")


def model_of(profiles: tuple[Profile, ...], minor: str) -> str:
    """The model a card of device minor ``minor`` with these profiles is registered
    with; raises ProfileError for a minor that is not a number, or a model longer
    than a model may be."""
    if not _MINOR.fullmatch(minor):
        raise ProfileError(f"minor {minor[:16]!r} is not a device number")
    words = [PREFIX, f"minor={minor}", *(f"{p.name}={p.id}" for p in profiles)]
    model = " ".join(words)
    if len(model) > MAX_NAME_LENGTH:
        raise ProfileError(f"its profiles do not fit in {MAX_NAME_LENGTH} characters")
    return model


def profiles_of(model: str) -> tuple[Profile, ...] | None:
    """The profiles a card's model lists (None: not a DRS card's model, or unreadable)."""
    words = model.split(" ")
    if len(words) < 3 or words[0] != PREFIX or minor_of(model) is None:
        return None
    found = []
    try:
        for word in words[2:]:
            name, sep, profile_id = word.partition("=")
            if not sep:
                return None
            found.append(profile(name, profile_id))
        return table(found)
    except ProfileError:
        return None


def minor_of(model: str) -> str | None:
    """The device minor number a DRS card's model names (None: none)."""
    words = model.split(" ")
    if len(words) < 2 or words[0] != PREFIX or not words[1].startswith("minor="):
        return None
    minor = words[1].removeprefix("minor=")
    return minor if _MINOR.fullmatch(minor) else None


def choose(profiles: tuple[Profile, ...], demand: DrsDemand) -> Profile | None:
    """The profile HAMi gives ``demand`` (None: no profile holds it). Memory above
    twice the largest profile's GB is read as MiB and rounded up to GB."""
    if demand.size is not None:
        return next((p for p in profiles if p.size == demand.size), None)
    biggest = max(p.memory_gb for p in profiles)
    memory = demand.memory
    if memory > biggest * 2:
        memory = math.ceil(memory / 1024)
    for p in profiles:
        if memory and p.memory_gb < memory:
            continue
        if demand.cores and cores(p, profiles) < demand.cores:
            continue
        return p
    return None


def granted(profiles: tuple[Profile, ...], memory_mib: int, share: int) -> Profile | None:
    """The profile a grant of ``memory_mib`` and ``share`` percent is (for the bind)."""
    return next(
        (p for p in profiles if p.memory_mib == memory_mib and cores(p, profiles) == share),
        None,
    )


__all__ = [
    "MAX_PROFILES",
    "Profile",
    "ProfileError",
    "choose",
    "cores",
    "granted",
    "largest",
    "minor_of",
    "model_of",
    "profile",
    "profiles_of",
    "table",
]
