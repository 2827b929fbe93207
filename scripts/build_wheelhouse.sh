#!/usr/bin/env bash
# Build an offline wheelhouse for a GPU host without network: executorch and the pure-Python packages the
# runtime imports, for a given Python version and platform. torch and triton are expected on the host.
#
#   scripts/build_wheelhouse.sh [DIR] [PYTHON_VERSION] [EXECUTORCH_VERSION]
#   e.g. scripts/build_wheelhouse.sh .whl 3.12 1.2.0
#
# On the host:  python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl
#               export PYTHONPATH=/tmp/site
# executorch 1.2 reads programs with `flatc`: the wheel ships it at executorch/data/bin/flatc; the runtime
# sets FLATC_EXECUTABLE to it (and makes it executable) when the variable is unset.
set -euo pipefail
DIR="${1:-.whl}"
PY="${2:-3.12}"
ET="${3:-1.2.0}"
mkdir -p "$DIR"
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
fetch() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
        "${platforms[@]}" -d "$DIR" "$@"
}
fetch "executorch==$ET"
# Pure-Python (or universal) packages executorch's deserializer and our runtime import.
for pkg in "flatbuffers>=24" "ruamel.yaml" "ruamel.yaml.clib" "tabulate" "packaging" "pyyaml" "click>=8.1" \
           "safetensors>=0.4" "tokenizers>=0.19" "typing-extensions>=4.10" "sympy" "mpmath==1.3.0"; do
    fetch "$pkg"
done
# The serving stack: mg-serve, its tests (the openai client) and scripts/bench_serve.py.
for pkg in fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection opentelemetry-api \
           uvicorn h11 anyio sniffio idna prometheus-client jinja2 markupsafe openai httpx2 httpcore2 jiter truststore; do
    fetch "$pkg"
done
ls -1 "$DIR"
