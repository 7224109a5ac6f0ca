"""The JSON schema a forced tool choice enforces (vLLM's construction), with what makes it usable.

A named function: its parameters; `required`: an array of {"name", "parameters"} objects (at most one without
`parallel_tool_calls`). Parameters are made strict as OpenAI and xgrammar read them (objects admit no undeclared
keys; no parameters means `{}`), else a small model writes keys of its own. Under `required` each tool's parameters
move to the root's `$defs` and their local `$ref`s are rewritten to point there.
"""

from __future__ import annotations

import copy

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
NESTED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema maps
LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # lists of schemas
SINGLE = ("items", "additionalItems", "not", "if", "then", "else", "contains", "propertyNames")  # one schema


def forced_schema(tools: list, mode: str, parallel: bool = True) -> dict:
    """The schema of a named function's arguments, or of `required`'s array of calls."""
    parameters = {t.function.name: strict(t.function.parameters) for t in tools}
    if mode != "required":
        return parameters[mode]
    options = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                 "parameters": {"$ref": f"#/$defs/{_escaped(name)}"}},
                "required": ["name", "parameters"], "additionalProperties": False} for name in parameters]
    defs = {name: _rerooted(schema, f"#/$defs/{_escaped(name)}") for name, schema in parameters.items()}
    array = {"type": "array", "minItems": 1, "items": options[0] if len(options) == 1 else {"anyOf": options},
             "$defs": defs}
    return array | ({} if parallel else {"maxItems": 1})


def strict(parameters: dict | None) -> dict:
    """A function's parameters as a forced call reads them (a copy; the request's own stays as sent)."""
    if not parameters or (parameters.get("type") == "object" and not parameters.get("properties")
                          and not _has_alternatives(parameters)):
        return dict(NO_ARGUMENTS)
    return closed(parameters)


def closed(schema: dict) -> dict:
    """A copy of `schema` whose object schemas with declared properties take no others where they leave it unsaid:
    OpenAI's strict reading (it refuses such a schema; xgrammar's strict mode, vLLM's default, closes it too)."""
    schema = copy.deepcopy(schema)
    _close_objects(schema)
    return schema


def _has_alternatives(schema: dict) -> bool:
    return any(key in schema for key in (*LISTS, "$ref", "additionalProperties", "patternProperties"))


def _close_objects(schema, merged: bool = False) -> None:
    """additionalProperties: false on every object schema with declared properties that leaves it unsaid; not on
    the parts of an allOf, the schema holding it, nor their alternatives (`merged`): each would refuse the keys the
    others declare."""
    if not isinstance(schema, dict):
        return
    merged = merged or "allOf" in schema
    if ("properties" in schema and "additionalProperties" not in schema and "patternProperties" not in schema
            and not merged):
        schema["additionalProperties"] = False
    for key in NESTED:
        for sub in (schema.get(key) or {}).values() if isinstance(schema.get(key), dict) else ():
            _close_objects(sub)
    for key in LISTS:
        for sub in schema.get(key) or () if isinstance(schema.get(key), list) else ():
            _close_objects(sub, merged=key == "allOf" or (merged and key in ("anyOf", "oneOf")))
    for key in SINGLE:
        _close_objects(schema.get(key))


def _rerooted(schema, root: str):
    """`schema` with every local `$ref` ("#", "#/...") pointing under `root` instead of the document's root."""
    if isinstance(schema, list):
        return [_rerooted(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _rerooted(value, root) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = root + ref[1:]
    return out


def _escaped(name: str) -> str:
    """A name as one JSON-pointer token (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")
