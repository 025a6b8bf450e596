"""An example agent to copy: a model behind any OpenAI-compatible endpoint, with two real tools.

* ``read_file`` reads a text file inside a sandbox directory (``$PHASELINE_SANDBOX``, default the
  current directory); a path that leaves it is refused. Reading twice is harmless, so it is
  idempotent: a call caught in flight by a crash is simply run again.
* ``calculate`` evaluates an arithmetic expression (numbers, ``+ - * / // % **`` and brackets)
  by walking its syntax tree, never with ``eval``.

Run it (``phaseline submit`` / ``phaseline chat`` name it ``actors.examples.assistant:agent``)
against OpenAI with ``$OPENAI_API_KEY`` set, or any other endpoint with ``$OPENAI_BASE_URL``
(``http://localhost:8080/v1`` for llama.cpp's server, ``http://localhost:11434/v1`` for Ollama,
``http://localhost:8000/v1`` for vLLM; a local server needs no key) and ``$PHASELINE_MODEL``.
``$PHASELINE_TEMPERATURE`` and ``$PHASELINE_MAX_TOKENS`` set the sampling temperature and the
cap on each reply (unset: the endpoint's defaults); at temperature 0 a local model answers the
same conversation the same way, which is what ``phaseline demo``'s exact verdict compares.
``$PHASELINE_MAX_TOOL_ROUNDS`` (default 20) bounds the tool rounds of a turn: a small model
with a small context (SmolLM2 on llama.cpp's server) keeps calling tools, and wraps up sooner.
Every process that runs turns (each Ray worker too) reads these variables.
"""

from __future__ import annotations

import ast
import operator
import os
from collections.abc import Callable
from pathlib import Path

from actors.engine.models.openai_chat import OpenAIChat
from actors.turn.agent import Agent, AgentSettings
from actors.turn.tools import ToolRegistry, tool

#: Largest file ``read_file`` returns, in characters (the rest is cut, and said so).
MAX_READ = 20_000

_OPERATORS: dict[type[ast.AST], Callable[..., float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def sandbox() -> Path:
    return Path(os.environ.get("PHASELINE_SANDBOX", ".")).resolve()


@tool(idempotent=True, timeout_s=10)
def read_file(path: str) -> str:
    """Read a text file of the sandbox directory.

    Args:
        path: The file's path, relative to the sandbox directory.
    """
    root = sandbox()
    target = (root / path).resolve()
    if not target.is_relative_to(root):
        raise PermissionError(f"{path} is outside the sandbox")
    text = target.read_text(errors="replace")
    if len(text) > MAX_READ:
        return text[:MAX_READ] + f"\n[cut: the file has {len(text):,} characters]"
    return text


def _value(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return float(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        if isinstance(node.op, ast.Pow) and abs(_value(node.right)) > 1000:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.operand))
    raise ValueError(f"not arithmetic: {ast.dump(node)[:80]}")


@tool(idempotent=True, timeout_s=5)
def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly as written.

    Args:
        expression: Numbers, + - * / // % ** and brackets, e.g. "(2 + 3) * 7".
    """
    result = _value(ast.parse(expression, mode="eval").body)
    return f"{result:g}"


def _number(name: str, kind: Callable[[str], float]) -> float | None:
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"${name} must be a number, not {raw!r}") from None


_max_tokens = _number("PHASELINE_MAX_TOKENS", int)

agent = Agent(
    model=OpenAIChat(
        model=os.environ.get("PHASELINE_MODEL", "gpt-4o-mini"),
        temperature=_number("PHASELINE_TEMPERATURE", float),
        max_tokens=None if _max_tokens is None else int(_max_tokens),
    ),
    tools=ToolRegistry([read_file, calculate]),
    system_prompt=(
        "You are a careful assistant. Use calculate for any arithmetic and read_file to look "
        "at files; say which file a fact came from."
    ),
    settings=AgentSettings(max_tool_rounds=int(_number("PHASELINE_MAX_TOOL_ROUNDS", int) or 20)),
    model_name=os.environ.get("PHASELINE_MODEL", "gpt-4o-mini"),
)
