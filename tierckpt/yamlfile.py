"""Strict YAML for config files: ``yaml.safe_load`` that refuses a key given twice in a mapping,
nesting deeper than 100 levels, and bytes that are not UTF-8 (each would otherwise load silently, or
fail with an error that names nothing)."""

from __future__ import annotations

import reprlib
import weakref
from pathlib import Path
from typing import Any

import yaml

__all__ = ["StrictLoader", "YAMLFileError", "load_yaml"]

_MAX_YAML_DEPTH = 100  # a hierarchy nests 5 deep; deeper input would only hit Python's recursion limit


class YAMLFileError(Exception):
    """Why a YAML file's bytes are no config document; the caller adds the file's name."""


class StrictLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, refusing a key twice in one mapping and nesting deeper than 100."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        # per mapping node, its own keys, kept before a merge (<<) that uses the node prepends its keys
        self._own_pairs: weakref.WeakKeyDictionary[yaml.Node, list[tuple[yaml.Node, yaml.Node]]] = (
            weakref.WeakKeyDictionary()
        )

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > _MAX_YAML_DEPTH:
                line = self.peek_event().start_mark.line + 1
                raise YAMLFileError(f"line {line}: nested more than {_MAX_YAML_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_mapping_node(self, anchor: Any) -> Any:
        node = super().compose_mapping_node(anchor)
        self._own_pairs[node] = list(node.value)
        return node

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            own = self._own_pairs.get(node)
            for key_node, _ in node.value if own is None else own:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # several << keys merge several mappings, as safe_load does
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in seen:
                        raise YAMLFileError(f"line {key_node.start_mark.line + 1}: duplicate key {reprlib.repr(key)}")
                    seen.add(key)
                except TypeError:
                    pass  # unhashable: the base class says so
        return super().construct_mapping(node, deep=deep)


def load_yaml(p: Path) -> Any:
    """Read ``p`` as UTF-8 and parse it as ``yaml.safe_load`` does, but strictly (:class:`StrictLoader`).

    Raises:
        OSError: the file cannot be read.
        YAMLFileError: it is not UTF-8, not YAML, repeats a key or nests too deep.
    """
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise YAMLFileError(f"not valid UTF-8 (byte {e.start})") from None
    loader = StrictLoader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise YAMLFileError(f"not valid YAML: {e}") from e
    except (ValueError, OverflowError) as e:  # a scalar its tag cannot hold: 2020-13-45, an int of 5000 digits
        raise YAMLFileError(f"not valid YAML: {e}") from e
    except RecursionError:
        raise YAMLFileError("not valid YAML: nested too deeply") from None
    finally:
        loader.dispose()
