"""A JSON schema with no finite instance (an object that must always hold another) is found before it runs;
schemas that may end are never refused for it."""

from __future__ import annotations

import re

import pytest

from mirror_rt.runtime.grammar import Constraint
from mirror_rt.runtime.schema_finite import unending

NODE = {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
ENDLESS = {
    "a required self-reference": ({"$defs": {"n": NODE}, "$ref": "#/$defs/n"}, "#/$defs/n"),
    "the root itself": ({"$ref": "#"}, "#"),
    "an array of at least one of itself": ({"type": "object", "required": ["k"], "properties": {
        "k": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}}}, "#"),
    "two that hold each other": ({"$defs": {
        "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
        "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
        "$ref": "#/$defs/a"}, "#/$defs/a"),
    "draft-04 definitions": ({"definitions": {"n": {"type": "object", "properties": {
        "c": {"$ref": "#/definitions/n"}}, "required": ["c"]}}, "type": "object",
        "properties": {"x": {"$ref": "#/definitions/n"}}, "required": ["x"]}, "#/definitions/n"),
    "every alternative endless": ({"$defs": {"n": NODE}, "anyOf": [{"$ref": "#/$defs/n"}, {"allOf": [
        {"type": "string"}, {"$ref": "#/$defs/n"}]}]}, "#/$defs/n"),
}
ENDING = {
    "an optional self-reference": {"$defs": {"n": {**NODE, "required": []}}, "$ref": "#/$defs/n"},
    "a tree whose children may be none": {"type": "object", "properties": {"k": {"type": "array", "items": {
        "$ref": "#"}}}, "required": ["k"]},
    "a null way out": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"n": {"$ref": "#"}},
                                                   "required": ["n"]}]},
    "a nullable type": {"type": ["object", "null"], "properties": {"n": {"$ref": "#"}}, "required": ["n"]},
    "a string way out of a pair": {"$defs": {
        "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
        "b": {"anyOf": [{"type": "string"}, {"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"},
    "an enum": {"enum": [{"a": 1}], "$defs": {"n": NODE}},
    "a plain object": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
    "the empty schema": {},
    "a reference to nothing (the engine's error, not this one)": {"$ref": "#/$defs/missing"},
}


@pytest.mark.parametrize("name", ENDLESS)
def test_an_endless_schema_is_named(name):
    schema, where = ENDLESS[name]
    assert unending(schema) == where
    with pytest.raises(ValueError, match=re.escape(f"no finite instance: a value of {where} must always hold another")):
        Constraint.json_schema(schema).grammar()


@pytest.mark.parametrize("name", ENDING)
def test_a_schema_that_may_end_is_not_refused(name):
    assert unending(ENDING[name]) is None
