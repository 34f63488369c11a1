"""A tool the model can call: its OpenAI function schema and four per-session hooks.

The schema is the OpenAI function-calling format SGLang's function calling uses:
    {"type": "function", "function": {"name": ..., "description": ..., "parameters": <JSON schema object>}}
A tool keeps per-trajectory state in the `ToolSession` the server hands it (`session.state[tool.name]`), never
on itself: one tool object serves every concurrent trajectory, and two sessions cannot see each other's state.
"""
from __future__ import annotations

import abc
import re
from dataclasses import dataclass, field
from typing import Any

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


class ToolError(RuntimeError):
    """A call the tool refuses (bad arguments, a failure of the tool's own work). The server turns it into a
    tool message for the model; it never reaches the trainer as an exception."""


@dataclass
class ToolSession:
    """One trajectory's isolated tool state. `state` maps tool name -> whatever that tool's `create` returned."""

    id: str
    state: dict[str, Any] = field(default_factory=dict)
    calls: list[dict[str, Any]] = field(default_factory=list)  # the call log: name, arguments, ok, output
    released: bool = False


def check_schema(schema: dict[str, Any]) -> str:
    """Validate one OpenAI function schema; returns the function's name."""
    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(schema.get("function"), dict):
        raise ValueError(f"tool schema must look like {{'type': 'function', 'function': {{...}}}}, got {schema!r}")
    fn = schema["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"tool schema: function.name must match {_NAME.pattern}, got {name!r}")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ValueError(f"tool {name!r}: function.parameters must be a JSON schema with type 'object', got {params!r}")
    props = params.get("properties", {})
    if not isinstance(props, dict):
        raise ValueError(f"tool {name!r}: parameters.properties must be an object")
    for req in params.get("required", []):
        if req not in props:
            raise ValueError(f"tool {name!r}: required parameter {req!r} is not in parameters.properties")
    return name


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


def check_arguments(schema: dict[str, Any], args: Any) -> dict[str, Any]:
    """The arguments as a dict, checked against the schema's required keys, known keys and simple types; raises
    ToolError with a message the model can learn from."""
    fn = schema["function"]
    if not isinstance(args, dict):
        raise ToolError(f"arguments of {fn['name']} must be a JSON object, got {type(args).__name__}")
    params = fn.get("parameters", {})
    props = params.get("properties", {})
    missing = [k for k in params.get("required", []) if k not in args]
    if missing:
        raise ToolError(f"{fn['name']}: missing required argument(s) {missing}")
    unknown = [k for k in args if k not in props]
    if unknown and params.get("additionalProperties", False) is False:
        raise ToolError(f"{fn['name']}: unknown argument(s) {unknown}; expected {sorted(props)}")
    for k, v in args.items():
        want = _JSON_TYPES.get(props.get(k, {}).get("type"))
        if want is not None and (not isinstance(v, want) or (isinstance(v, bool) and want is not bool)):
            raise ToolError(f"{fn['name']}: argument {k!r} must be of type {props[k]['type']}, got {type(v).__name__}")
    return args


class BaseTool(abc.ABC):
    """Subclass, set `schema`, implement `call`. Blocking work in `call` is fine: the server runs it in a worker
    thread with a timeout."""

    schema: dict[str, Any]

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    def create(self, session: ToolSession) -> Any:
        """Per-session state (stored as session.state[self.name]); None by default."""
        return None

    @abc.abstractmethod
    def call(self, session: ToolSession, args: dict[str, Any]) -> str:
        """Do the call; return the text the model sees. Raise ToolError for a refused call."""

    def calc_reward(self, session: ToolSession) -> float:
        """This tool's contribution to the trajectory's reward (0 by default)."""
        return 0.0

    def release(self, session: ToolSession) -> None:
        """Free what `create` allocated. Called exactly once per session, on every exit path."""
