"""The table of validation rules (config/rules.py runs it): each rule, registered with `@rule(name)`,
takes a RunConfig and returns an error message or None. Its own module so that the modules holding
rules (rules.py, rules_targets.py) share it without importing each other."""

from __future__ import annotations

from typing import Callable

from swiftlite.config.schema import RunConfig

Rule = Callable[[RunConfig], "str | None"]
RULES: list[tuple[str, Rule]] = []


def rule(name: str):
    def deco(fn: Rule) -> Rule:
        RULES.append((name, fn))
        return fn
    return deco
