"""Reading a policy's YAML text: safe YAML only, bounded before anything is built from it.

``read_yaml`` turns text into plain Python data (or a PolicyError naming the file, line and
column); ``autoprec.policy.validation`` then checks that data against the schema.
"""

from __future__ import annotations

from typing import Any

import yaml

from autoprec.errors import PolicyError
from autoprec.io.fileio import MiB, brief

#: A policy is a reviewed artifact that CI gates load: its size and shape are bounded
#: before anything is built from it. A policy of a 10,000-layer model with reasons is
#: about 1.2 MiB (PyYAML reads ~1 MiB/s); it nests 3 levels (provenance mappings 4).
MAX_POLICY_BYTES = 4 * MiB
MAX_DEPTH = 16
#: Integers in a policy are versions, batch sizes and counts: a 40-digit one is a typo,
#: and a 5000-digit one would hit Python's int/str conversion limit.
MAX_INT_DIGITS = 40


class PolicyLoader(yaml.SafeLoader):
    """yaml.safe_load, bounded and strict: no aliases (``*name`` — an alias bomb of a few
    hundred bytes expands to gigabytes), at most MAX_DEPTH levels of nesting (deeper ones
    would exhaust the recursion of PyYAML's composer), integers of at most MAX_INT_DIGITS
    digits, keys that are scalars, and no key given twice in one mapping (a reviewer
    reading ``layers`` top-down must see the rule that applies)."""

    _depth = 0

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"alias *{brief(event.anchor)[1:-1]}: a policy may not use YAML "
                "aliases (write the value out)", event.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels",
                    self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                kind = "a list" if isinstance(key_node, yaml.SequenceNode) else "a mapping"
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"a key is {kind}; keys must be plain names (module paths are strings)",
                    key_node.start_mark)
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark,
                    f"key {brief(key)} given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):  # type: ignore[no-untyped-def]
        digits = sum(c.isdigit() for c in str(node.value))
        if digits > MAX_INT_DIGITS:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {digits} digits (at most {MAX_INT_DIGITS})",
                node.start_mark)
        return super().construct_yaml_int(node)


PolicyLoader.add_constructor("tag:yaml.org,2002:int", PolicyLoader.construct_yaml_int)


def read_yaml(text: str, source: str = "<policy>") -> Any:
    """The data of policy YAML text (safe YAML, bounded: ``PolicyLoader``); ``source``
    names it in messages."""
    if len(text) > MAX_POLICY_BYTES:
        raise PolicyError(f"{source}: larger than a policy may be "
                          f"({MAX_POLICY_BYTES // MiB} MiB)")
    try:
        data = yaml.load(text, Loader=PolicyLoader)  # safe_load, bounded (see the loader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        what = err.problem or err.context or "syntax error"
        if isinstance(err, yaml.constructor.ConstructorError) and err.problem and \
                "could not determine a constructor" in err.problem:
            what += " (policies are plain YAML, read with yaml.safe_load: no tags)"
        raise PolicyError(f"{where}: not valid YAML: {what}") from None
    except yaml.reader.ReaderError as err:  # a NUL byte, a control character
        line = text.count("\n", 0, err.position) + 1
        col = err.position - (text.rfind("\n", 0, err.position) + 1) + 1
        char = f"#x{err.character:04x}" if isinstance(err.character, int) else \
            brief(err.character)
        raise PolicyError(f"{source}:{line}:{col}: not valid YAML: character {char} is not "
                          "allowed in a YAML file") from None
    except yaml.YAMLError as err:
        raise PolicyError(f"{source}: not valid YAML: {brief(str(err))}") from None
    return data


__all__ = ["MAX_DEPTH", "MAX_INT_DIGITS", "MAX_POLICY_BYTES", "PolicyLoader", "read_yaml"]
