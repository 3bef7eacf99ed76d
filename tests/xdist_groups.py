"""Which tests must run on one pytest-xdist worker: those that share a fixture wider than a test.

scripts/test.sh runs the suite on two workers (``-n 2 --dist loadgroup``). A session or module
fixture runs once per worker that uses it, and many of them launch ranks (tens of seconds each):
``exactness_runs`` and ``small_reference`` (conftest.py) are used by several modules, others by the
tests of one module. Every test that uses such a fixture gets an ``xdist_group`` mark, the same for
every test that shares one with it, directly or through another test (the groups are the connected
sets of tests and fixtures), so xdist sends them all to one worker. Tests that share no such
fixture get no mark and go wherever a worker is free.

A module or class fixture counts as its module's: the tests of a module that use any of them form
one group. Session and package fixtures of the suite itself (conftest.py, a test module) count by
name; those of pytest and its plugins (``tmp_path_factory``, ...) are cheap and left out.
"""

from __future__ import annotations

WIDE_SCOPES = ("session", "package", "module", "class")


def _keys(item) -> list[str]:
    """The wide fixtures ``item`` uses, as group keys: its module for a module or class fixture,
    the fixture's name for a session or package fixture of the suite."""
    keys = []
    for name in item.fixturenames:
        definitions = item._fixtureinfo.name2fixturedefs.get(name)
        if not definitions:   # a parametrize argument, or a fixture of the request itself
            continue
        fixture = definitions[-1]
        if fixture.scope not in WIDE_SCOPES or not fixture.baseid:   # baseid "": pytest's or a plugin's
            continue
        keys.append(item.module.__name__ if fixture.scope in ("module", "class") else f"fixture {name}")
    return keys


def groups(items) -> dict[int, str]:
    """Each grouped item's index in ``items`` -> its group's name (the smallest key of its set)."""
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    item_keys = [_keys(item) for item in items]
    for keys in item_keys:
        for key in keys[1:]:
            a, b = root(keys[0]), root(key)
            parent[max(a, b)] = min(a, b)
    return {index: root(keys[0]) for index, keys in enumerate(item_keys) if keys}


def add_group_marks(items) -> None:
    import pytest
    for index, name in groups(items).items():
        items[index].add_marker(pytest.mark.xdist_group(name.replace(" ", "_")))


def groups_lost(session) -> str | None:
    """Under ``--dist loadgroup``, pytest-xdist appends each marked test's group to its node id
    (``...::test@group``), which is all its scheduler reads. Where a pytest / pytest-xdist pair no
    longer does (pytest 9.2 with pytest-xdist 3.8: the id it writes is not the one pytest reads), the
    groups are lost without a word and their fixtures run on both workers: the message saying so, or
    None."""
    import pytest
    if not getattr(session.config.option, "loadgroup", False):
        return None
    lost = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if not lost:
        return None
    import xdist
    return (f"pytest-xdist {xdist.__version__} did not take the xdist_group of {len(lost)} tests ({lost[0]}, ...) "
            f"under pytest {pytest.__version__}: install the versions pyproject.toml allows (bash scripts/setup.sh), "
            f"or run with -n 0")
