"""Whether a JSON schema has a finite instance: one an answer can finish.

A least fixed point over the schema's local references; generous wherever unsure, so it refuses only schemas that
surely never end. Design notes: docs/design/runtime.md.
"""

from __future__ import annotations

SCALARS = {"string", "number", "integer", "boolean", "null"}


def unending(schema) -> str | None:
    """The JSON pointer of a part of `schema` that surely has no finite instance, and the whole schema with it;
    None when it may have one (see the module docstring)."""
    refs = {}
    _collect_refs(schema, schema, refs)
    finite = {ref for ref, target in refs.items() if target is None}  # unresolved: the grammar engine says so
    while True:  # grow the set of references shown finite until it stops growing
        grown = {ref for ref, target in refs.items() if ref not in finite and _finite(target, finite)}
        if not grown:
            break
        finite |= grown
    if _finite(schema, finite):
        return None
    return next((ref for ref in refs if ref not in finite), "#")


def _collect_refs(node, root, out: dict) -> None:
    """Every local `$ref` ("#", "#/a/b") in `node`, to its target in `root` (None: it resolves to nothing)."""
    if isinstance(node, list):
        for item in node:
            _collect_refs(item, root, out)
        return
    if not isinstance(node, dict):
        return
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in out:
        out[ref] = target = _resolve(root, ref)
        _collect_refs(target, root, out)
    for value in node.values():
        _collect_refs(value, root, out)


def _resolve(root, ref: str):
    node = root
    for token in ref[1:].split("/")[1:]:  # "#": none
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


def _finite(schema, finite: set[str]) -> bool:
    """Whether `schema` surely has a finite instance, given the references in `finite` do (others: unknown)."""
    if schema is True or not isinstance(schema, dict):
        return schema is not False
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in finite:
        return False
    if any(not _finite(part, finite) for part in schema.get("allOf") or ()):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and not any(_finite(part, finite) for part in schema[key]):
            return False
    if "enum" in schema or "const" in schema:
        return True
    types = schema.get("type")
    types = set(types) if isinstance(types, list) else {types} if isinstance(types, str) else None
    if types is None or types & SCALARS:
        return True
    return ("object" in types and _object_finite(schema, finite)) or ("array" in types and
                                                                       _array_finite(schema, finite))


def _object_finite(schema: dict, finite: set[str]) -> bool:
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    extra = schema.get("additionalProperties", True)
    return all(_finite(properties[name] if name in properties else extra, finite)
               for name in schema.get("required") or () if isinstance(name, str))


def _array_finite(schema: dict, finite: set[str]) -> bool:
    least = schema.get("minItems", 0)
    if not isinstance(least, int) or least <= 0:
        return True
    prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
    items = schema.get("items", True)
    return all(_finite(part, finite) for part in prefix[:least]) and (least <= len(prefix) or _finite(items, finite))
