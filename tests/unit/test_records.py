"""``@record`` behaves as ``@dataclass`` does, for everything the plugin and its users rely on.

Each behaviour is asked of a record and of the same class built by ``dataclasses.dataclass``, so
the expected answer is the standard library's, not a copy of ours.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from mbridge_mxfp8_plugin.common.records import record


def _pair(frozen: bool) -> tuple[type, type]:
    """The same class body under ``@record`` and under ``@dataclass``."""

    def body() -> type:
        class Knob:
            """A knob."""

            name: str
            value: Any = None
            tags: list[str] = dataclasses.field(default_factory=list)
            hidden: int = dataclasses.field(default=0, repr=False, compare=False)

            def shout(self) -> str:
                return self.name.upper()

        return Knob

    ours = record(frozen=frozen)(body())
    theirs = dataclasses.dataclass(frozen=frozen)(body())
    return ours, theirs


def _hash_or_error(obj: object) -> object:
    try:
        return hash(obj)
    except TypeError:
        return TypeError


@pytest.mark.parametrize("frozen", [True, False])
def test_construction_repr_eq_and_introspection_match_dataclass(frozen: bool):
    ours, theirs = _pair(frozen)
    for args, kwargs in [(("a",), {}), (("a", 1), {"tags": ["x"]}), ((), {"name": "b", "hidden": 5})]:
        a, b = ours(*args, **kwargs), theirs(*args, **kwargs)
        assert repr(a).split("(", 1)[1] == repr(b).split("(", 1)[1]
        assert dataclasses.asdict(a) == dataclasses.asdict(b)
        assert [f.name for f in dataclasses.fields(a)] == [f.name for f in dataclasses.fields(b)]
        assert dataclasses.is_dataclass(a) and a.shout() == b.shout()
        assert (a == ours(*args, **kwargs)) and (b == theirs(*args, **kwargs))
        assert a == dataclasses.replace(a, hidden=99)  # not compared, as in the dataclass
        assert a != dataclasses.replace(a, value="other")
        assert a != b  # another class: never equal, as dataclasses compare
        assert (type(a).__hash__ is None) == (type(b).__hash__ is None)
        if frozen:  # hashed by the compared fields: a list among them fails both alike
            assert _hash_or_error(a) == _hash_or_error(ours(*args, **kwargs))
            assert (_hash_or_error(a) is TypeError) == (_hash_or_error(b) is TypeError)
    assert ours("a").tags is not ours("a").tags  # a fresh default per instance


@pytest.mark.parametrize("frozen", [True, False])
def test_bad_calls_fail_as_dataclass_calls_do(frozen: bool):
    for cls in _pair(frozen):
        with pytest.raises(TypeError, match="name"):
            cls()
        with pytest.raises(TypeError, match="nope"):
            cls("a", nope=1)
        with pytest.raises(TypeError, match="name"):
            cls("a", name="b")
        with pytest.raises(TypeError):
            cls("a", 1, [], 0, "extra")


def test_frozen_refuses_writes_and_mutable_takes_them():
    frozen_ours, frozen_theirs = _pair(True)
    for cls in (frozen_ours, frozen_theirs):
        obj = cls("a")
        with pytest.raises(dataclasses.FrozenInstanceError):
            obj.value = 2  # type: ignore[misc]
        with pytest.raises(dataclasses.FrozenInstanceError):
            del obj.value  # type: ignore[misc]
    mutable, _ = _pair(False)
    obj = mutable("a")
    obj.value = 2
    assert obj.value == 2


def test_inheritance_post_init_and_own_methods():
    @record
    class Base:
        """Base."""

        a: int
        b: int = 2

    @record
    class Child(Base):
        """Child."""

        c: int = 3
        seen: list[int] = dataclasses.field(default_factory=list, compare=False)

        def __post_init__(self) -> None:
            self.seen.append(self.a + self.b + self.c)

        def __repr__(self) -> str:
            return "mine"

    child = Child(1, c=10)
    assert [f.name for f in dataclasses.fields(child)] == ["a", "b", "c", "seen"]
    assert (child.a, child.b, child.c, child.seen) == (1, 2, 10, [13])
    assert repr(child) == "mine"  # the class's own method is kept, as dataclass keeps it
    assert Child.__doc__ == "Child."
    assert hash(Base(1, 2)) == hash((1, 2))  # the dataclass rule: the compared fields' tuple


def test_copies_and_undocumented_classes():
    frozen, _ = _pair(True)
    obj = frozen("a", 1, ["t"])
    assert copy.deepcopy(obj) == obj and copy.copy(obj) == obj

    @record
    class Bare:
        x: int
        y: str = ""

    assert Bare.__doc__ == "Bare(x, y)"  # a name, as dataclass makes one, without inspect


def test_a_frozen_record_may_not_write_its_own_setattr():
    class Writes:
        x: int

        def __setattr__(self, name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

    with pytest.raises(TypeError, match="__setattr__"):
        record(Writes)
