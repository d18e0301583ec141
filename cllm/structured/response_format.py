"""OpenAI ``response_format`` as SamplingParams constraint fields."""
from __future__ import annotations

from typing import Any


def response_format_constraint(response_format: Any) -> dict[str, Any]:
    """SamplingParams keyword arguments for a ``response_format``: ``{"type": "text"}`` (none),
    ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``,
    or (Python API) a pydantic model class. ValueError names the bad value."""
    if response_format is None:
        return {}
    schema_of = getattr(response_format, "model_json_schema", None)
    if isinstance(response_format, type) and callable(schema_of):
        return {"json_schema": schema_of()}
    if not isinstance(response_format, dict):
        raise ValueError(f"invalid response_format={response_format!r}: must be an object with a 'type'")
    kind = response_format.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"invalid response_format={response_format!r}: json_schema.schema must be a JSON Schema object")
        return {"json_schema": schema}
    raise ValueError(f"invalid response_format={kind!r}: type must be text, json_object or json_schema")
