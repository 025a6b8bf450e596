#!/usr/bin/env bash
# Create .venv and install phaseline with its dev tools, once per pyproject.toml version.
# Sourced by scripts/test and scripts/demo; safe to run on a fresh machine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.phaseline-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT[dev]"
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
