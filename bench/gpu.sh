#!/usr/bin/env bash
# The one-shot GPU benchmark from a clean checkout, on a machine without network access.
#
#   bench/gpu.sh [bench.gpu arguments]    run `python3 -m bench.gpu`; packages it needs that this
#                                         python lacks are installed from wheels in .whl/ first
#   bench/gpu.sh --dry-run [arguments]    print the wheels this python needs (and which .whl/
#                                         holds) and the cases in order; install and run nothing
#   bench/gpu.sh fetch-wheels [3.12]      on a machine with a package registry: put those wheels
#                                         into .whl/ for the GPU machine's Python (default 3.12,
#                                         manylinux x86_64); .whl/ is not committed
#
# The benchmark needs torch (the GPU machine's own CUDA build) and, from requirements.txt,
# deepspeed, pyyaml, tensorboard, tqdm, numpy and xxhash; the data pipeline's packages are not
# used (synthetic tokens). The GPU machine's image has torch, numpy, pyyaml, tensorboard, tqdm,
# xxhash, psutil, py-cpuinfo, msgpack, einops, packaging, transformers and safetensors, but not
# deepspeed nor its imports hjson and pydantic: those are the wheels below.
# tests/test_bench_gpu.py checks that every package bench.gpu imports is in one of the two.
# Set PYTHON to use another interpreter than python3.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=.whl

# deepspeed 0.19.8 is published as a source archive only; the rest are its imports that GPU
# images often lack, at the versions this project's environment resolves them to.
PURE_WHEELS=(deepspeed==0.19.8 hjson==3.1.0 pydantic==2.14.4 annotated-types==0.8.0
             typing-inspection==0.4.5 typing-extensions==4.16.0)
BINARY_WHEELS=(pydantic-core==2.50.5)
IMPORTS="import deepspeed, yaml, tensorboard, tqdm, numpy, xxhash"

if [[ "${1:-}" == "fetch-wheels" ]]; then
    version=${2:-3.12}
    mkdir -p "$WHEELS"
    # deepspeed builds into a pure-Python wheel (its CUDA ops are compiled on first use, and
    # the benchmark uses none); the others are downloaded as built for the target Python.
    DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps -w "$WHEELS" "${PURE_WHEELS[@]}"
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" "${BINARY_WHEELS[@]}"
    ls "$WHEELS"
    exit 0
fi

if [[ " $* " == *" --dry-run "* ]]; then
    version=$($PY -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    echo "wheels for $PY (Python $version), in $WHEELS/ from 'bench/gpu.sh fetch-wheels $version':"
    show() {  # REQUIREMENT TAGS: the wheel's file name and whether $WHEELS/ holds it
        local name=${1%%==*} status=missing
        local file="${name//-/_}-${1#*==}-$2.whl"
        if compgen -G "$WHEELS/$file" >/dev/null; then status=present; fi
        printf '  %-28s %-56s %s\n' "$1" "$file" "$status"
    }
    for requirement in "${PURE_WHEELS[@]}"; do show "$requirement" py3-none-any; done
    for requirement in "${BINARY_WHEELS[@]}"; do show "$requirement" "cp${version/./}-*manylinux*_x86_64"; done
    if $PY -c "$IMPORTS" >/dev/null 2>&1; then
        echo "$PY imports the packages they hold already: a run would install none"
    fi
    echo
    exec $PY -m bench.gpu "$@"
fi

if ! $PY -c "$IMPORTS" 2>/dev/null; then
    if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
        echo "error: $PY lacks packages the benchmark needs ($IMPORTS) and $WHEELS/ holds no wheels;" \
             "run 'bench/gpu.sh fetch-wheels' where a package registry is reachable" >&2
        exit 2
    fi
    site=$(mktemp -d)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$WHEELS"/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    if ! missing=$($PY -c "$IMPORTS" 2>&1); then
        echo "error: still missing after installing $WHEELS/: $(echo "$missing" | tail -1)" >&2
        exit 2
    fi
fi
exec $PY -m bench.gpu "$@"
