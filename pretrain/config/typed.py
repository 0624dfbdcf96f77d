"""The one typed reader: parsed YAML/JSON checked against dataclass annotations.

    cfg = read_typed(RunConfig, raw, origin=lambda key: "run.yaml", error=ConfigError)

Run configs, sweep files and run summaries all read through here, so a mistake reads the same
everywhere: one line naming where the value came from and the dotted key, e.g.
`run.yaml: train.max_steps must be an integer, got 'ten'`."""
from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from typing import Any, Callable

import yaml

YAML11_EXPONENT = re.compile(r"[-+]?\d+(\.\d*)?[eE][-+]?\d+")
"""Numbers such as 3e-4 that PyYAML (YAML 1.1) reads as strings; float fields accept them."""
YAML11_BOOLEANS = {"yes": True, "on": True, "true": True, "no": False, "off": False, "false": False}
"""YAML 1.1's boolean words. Only true and false are booleans when read (as in YAML 1.2), so that
a text key keeps `off` or `no` as the word it is; a true/false key accepts all of them."""
BOOL_TAG = "tag:yaml.org,2002:bool"


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's booleans and duplicate keys refused."""

    def construct_mapping(self, node, deep=False):
        first_line = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} at line {line} (first at line {first_line[key]}); "
                    "a second one would silently replace the first: merge them", key_node.start_mark)
            first_line[key] = line
        return super().construct_mapping(node, deep)


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


class YAMLError(ValueError):
    """Text that is not valid YAML, or has a key twice; one line with the position."""


def load_yaml(text: str, where: str) -> Any:
    """Parse a YAML document the way every config and sweep file is read (see `_Loader`)."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        if isinstance(e, yaml.constructor.ConstructorError) and e.problem and e.problem.startswith("duplicate"):
            raise YAMLError(f"{where}: {e.problem}") from None
        raise YAMLError(f"{where}: not valid YAML ({' '.join(str(e).split())})") from None


def parse_override(item: str, error: type[Exception] = ValueError) -> tuple[str, Any]:
    """A command-line `key.sub=value` as (key, value), the value parsed as a YAML scalar (text
    that is not YAML stays text); `error` for an item without `=` or key."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise error(f"command line: override {item!r} is not of the form key.sub=value")
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        value = text
    return key.strip(), value


def read_typed(tp: Any, value: Any, origin: Callable[[str], str], error: type[Exception] = ValueError,
               key: str = "") -> Any:
    """`value` converted to the annotation `tp` (dataclasses built from mappings, missing fields
    taking their defaults; int -> float is the only conversion), or `error` raised with one line
    `"{origin(key)}: ..."`. `origin(key)` says where the value at dotted `key` came from."""
    def fail(expected: str):
        raise error(f"{origin(key)}: {key or 'the top level'} must be {expected}, got {value!r}")

    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        (inner,) = [t for t in options if t is not type(None)]
        return read_typed(inner, value, origin, error, key)
    if dataclasses.is_dataclass(tp):
        return _read_dataclass(tp, value, origin, error, key)
    if typing.get_origin(tp) is typing.Literal:
        # read as the choices' type; the choice itself is checked with the rest of the tree
        # (`validation.validate`, whose message names the choices)
        (kind,) = {type(choice) for choice in typing.get_args(tp)}
        return read_typed(kind, value, origin, error, key)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, str) and value.lower() in YAML11_BOOLEANS:
            return YAML11_BOOLEANS[value.lower()]
        return value if isinstance(value, bool) else fail("true or false")
    if tp is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else fail("an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and YAML11_EXPONENT.fullmatch(value.strip()):
            return float(value)
        return fail("a number")
    if tp is str:
        if isinstance(value, bool):  # true/false as the word written
            return str(value).lower()
        return value if isinstance(value, str) else fail("a string")
    container = typing.get_origin(tp)
    if container is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            fail("a list")
        return [read_typed(item, v, origin, error, f"{key}[{i}]") for i, v in enumerate(value)]
    if container is dict:
        _, item = typing.get_args(tp)
        if not isinstance(value, dict):
            fail("a mapping")
        return {str(k): read_typed(item, v, origin, error, f"{key}.{k}" if key else str(k))
                for k, v in value.items()}
    raise TypeError(f"unsupported annotation {tp} for {key}")


def _read_dataclass(cls: type, raw: Any, origin, error, key: str) -> Any:
    where = key or "the top level"
    if not isinstance(raw, dict):
        raise error(f"{origin(where)}: {where} must be a mapping, got {raw!r}")
    prefix = f"{key}." if key else ""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in raw:
        if name not in fields:
            close = difflib.get_close_matches(str(name), list(fields), n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise error(f"{origin(prefix + str(name))}: unknown key {prefix}{name}{hint}")
    for name, f in fields.items():
        if name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise error(f"{origin(prefix + name)}: missing key {prefix}{name}")
    return cls(**{name: read_typed(hints[name], value, origin, error, prefix + name)
                  for name, value in raw.items()})
