"""agentkv._bounded.BoundedDict: at most ``cap`` keys, the least recently seen evicted first."""

import pytest

from agentkv._bounded import BoundedDict


def test_inserting_past_the_cap_evicts_the_oldest_key():
    d: BoundedDict[str, int] = BoundedDict(2)
    d["a"], d["b"], d["c"] = 1, 2, 3
    assert list(d.items()) == [("b", 2), ("c", 3)]
    assert len(d) == 2


def test_setting_or_touching_a_key_makes_it_the_most_recently_seen():
    d: BoundedDict[str, int] = BoundedDict(2)
    d["a"], d["b"] = 1, 2
    d["a"] = 10  # seen again: "b" is now the oldest
    d["c"] = 3
    assert list(d) == ["a", "c"]
    d.touch("a")
    d["e"] = 5
    assert list(d) == ["a", "e"]


def test_reads_do_not_change_the_eviction_order():
    d: BoundedDict[str, int] = BoundedDict(2)
    d["a"], d["b"] = 1, 2
    assert d["a"] == 1 and d.get("a") == 1 and "a" in d
    d["c"] = 3
    assert list(d) == ["b", "c"]


def test_mapping_api_and_edge_caps():
    d: BoundedDict[str, int] = BoundedDict(3)
    d["a"] = 1
    assert d.pop("a") == 1 and d.pop("a", None) is None and len(d) == 0
    with pytest.raises(KeyError):
        d.touch("missing")
    zero: BoundedDict[str, int] = BoundedDict(0)
    zero["a"] = 1
    assert len(zero) == 0 and zero.cap == 0
    with pytest.raises(ValueError):
        BoundedDict(-1)


def test_a_lower_cap_forgets_the_least_recently_seen_keys_at_once():
    d = BoundedDict[str, int](4)
    for n, key in enumerate("abcd"):
        d[key] = n
    d.touch("a")
    d.cap = 2
    assert list(d) == ["d", "a"] and d.cap == 2
    with pytest.raises(ValueError):
        d.cap = -1
