"""The Python tool: the model's code runs in `mtrain.tools.sandbox` (a subprocess per call, hard limits)."""
from __future__ import annotations

from typing import Any

from mtrain.tools.base import BaseTool, ToolError, ToolSession
from mtrain.tools.sandbox import SandboxLimits, run_python


class PythonTool(BaseTool):
    schema = {"type": "function", "function": {
        "name": "python",
        "description": "Run a Python 3 script and return what it prints (stdout, then stderr). Each call starts "
                       "fresh: nothing is kept between calls. Use print() to see results.",
        "parameters": {"type": "object", "properties": {
            "code": {"type": "string", "description": "the script"}}, "required": ["code"]}}}

    def __init__(self, limits: SandboxLimits = SandboxLimits(), python: str | None = None):
        self.limits, self.python = limits, python

    def create(self, session: ToolSession) -> dict[str, int]:
        return {"calls": 0, "errors": 0}

    def call(self, session: ToolSession, args: dict[str, Any]) -> str:
        state = session.state[self.name]
        state["calls"] += 1
        r = run_python(args["code"], self.limits, python=self.python)
        if not r.ok:
            state["errors"] += 1
        parts = []
        if r.stdout:
            parts.append(r.stdout.rstrip("\n"))
        if r.stderr:
            parts.append(r.stderr.rstrip("\n"))
        if r.over_disk:
            parts.append(f"Error: the script wrote more than {self.limits.max_disk_mb} MB or "
                         f"{self.limits.max_files} files and was killed")
        elif r.timed_out:
            parts.append(f"Error: the script ran past the {self.limits.wall_s:g} s limit and was killed")
        elif r.exit_code is not None and r.exit_code < 0:
            parts.append(f"Error: the script was killed by signal {-r.exit_code} (CPU limit {self.limits.cpu_s} s, "
                         f"memory limit {self.limits.memory_mb} MB)")
        elif r.exit_code:
            parts.append(f"(exit code {r.exit_code})")
        if r.truncated:
            parts.append("[output truncated]")
        text = "\n".join(parts) if parts else "(no output)"
        if not r.ok:  # the model sees the output and the reason; the call counts as a tool error
            raise ToolError(text)
        return text
