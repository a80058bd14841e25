#!/usr/bin/env bash
# install.sh of an offline bundle (scripts/offline-bundle.sh): installs the gateway on a host
# without a package registry. Checks the parts against SHA256SUMS and every unpacked file against
# the manifest, unpacks the repository, makes DIR/.venv from the bundle's wheels (pip --no-index),
# builds llama-cpp-python for the backend from the bundled sdist (scripts/install-llama-cpp.sh),
# optionally llama-server from the same source (benchmarks/build-llama-server.sh), and registers
# the bundled models. Needs the bundle's Python version, g++, cmake, make, patch (and nvcc for CUDA).
#
# usage: bash install.sh [--dir DIR] [--backend cuda|cpu|vulkan] [--llama-server] [--no-build] [--check]
#   --dir DIR       where the gateway goes (default: ./llm-gateway)
#   --backend       the llama.cpp build (default: the one the bundle was made for)
#   --llama-server  also build llama-server, for benchmarks/bench_speed.py --server-bin
#   --no-build      all but the llama.cpp builds (the gateway cannot serve yet)
#   --check         only check and unpack the bundle
#   PYTHON=python3.12  the interpreter;  CUDA_ARCH=90  CUDA architectures (default: native)
#   LLAMA_PATCHES="benchmarks/patches/ggml-cuda-green-contexts.patch"  patches for both builds
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir=llm-gateway; backend=""; server=0; build=1; check=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir="$2"; shift ;;
    --backend) backend="$2"; shift ;;
    --llama-server) server=1 ;;
    --no-build) build=0 ;;
    --check) check=1 ;;
    -h|--help) sed -n 2,16p "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$dir"; dir="$(cd "$dir" && pwd)"
b="$dir/offline-bundle"

echo "checking the parts in $here" >&2
(cd "$here" && grep '\.part-' SHA256SUMS | sha256sum -c --quiet -)
rm -rf "$b"; mkdir -p "$b"
cat "$here"/llm-gateway.tar.part-* | tar xf - -C "$b"
(cd "$b" && sha256sum -c --quiet manifest.sha256)
. "$b/bundle.env"
echo "bundle of commit $BUNDLE_COMMIT (CPython $BUNDLE_PYTHON, $BUNDLE_PLATFORM): every file checked" >&2
[ "$check" = 0 ] || exit 0

tar xzf "$b/src/llm-gateway.tar.gz" -C "$dir"
cd "$dir"
py="${PYTHON:-python3}"
have="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[ "$have" = "$BUNDLE_PYTHON" ] || { echo "the wheels are for Python $BUNDLE_PYTHON, $py is $have: set PYTHON" >&2; exit 2; }
"$py" -c 'import ensurepip, venv' 2> /dev/null || { echo "$py has no venv (Debian: python3-venv)" >&2; exit 2; }
[ -x .venv/bin/python ] || "$py" -m venv .venv
export PIP_NO_INDEX=1 PIP_FIND_LINKS="$b/wheels"
pipi() { .venv/bin/python -m pip install -q --require-hashes --no-deps "$@"; }
[ ! -f "$b/locks/build.txt" ] || pipi -r "$b/locks/build.txt"

backend="${backend:-$BUNDLE_BACKEND}"
sdist="$(ls "$b"/src/llama_cpp_python-*.tar.gz 2>/dev/null || true)"
if [ "$build" = 1 ]; then
  [ -n "$sdist" ] || { echo "the bundle has no llama-cpp-python source (made with --no-llama-src)" >&2; exit 2; }
  for t in g++ cmake make patch $([ "$backend" = cuda ] && echo nvcc); do
    command -v "$t" > /dev/null || { echo "the build needs $t" >&2; exit 2; }
  done
  [ "$backend" != cuda ] || export CUDA_CMAKE_ARGS="${CUDA_CMAKE_ARGS:--DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-native}}"
  LLAMA_CPP_SDIST="$sdist" bash scripts/install-llama-cpp.sh "$backend" .venv/bin/python
  echo "$backend" > .venv/llama-cpp-backend
fi
for lock in "$b"/locks/*.txt; do
  [ "$(basename "$lock")" = build.txt ] || pipi -r "$lock"
done
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .

# The models: Hub files into the Hub cache, GGUF files registered by name.
if [ -d "$b/hf" ]; then
  hub="${HF_HUB_CACHE:-${HF_HOME:-$HOME/.cache/huggingface}/hub}"
  mkdir -p "$hub" && cp -r "$b/hf/." "$hub/"
  echo "Hub models in $hub (serve with HF_HUB_OFFLINE=1)" >&2
fi
if [ -f "$b/models/gguf.list" ]; then
  while read -r name file; do
    printf 'FROM %s\n' "$b/models/$file" > "$b/Modelfile"
    .venv/bin/gateway create "$name" -f "$b/Modelfile"
  done < "$b/models/gguf.list"
fi

bin=""
if [ "$server" = 1 ] && [ "$build" = 1 ]; then
  bin="$(LLAMA_SRC="$sdist" bash benchmarks/build-llama-server.sh "$backend")"
fi
echo "installed in $dir. Serve: cd $dir && .venv/bin/gateway serve" >&2
[ -z "$bin" ] || echo "Benchmark: cd $dir && .venv/bin/python benchmarks/bench_speed.py --backend $backend --server-bin $bin --json bench-results/speed-$backend.json" >&2
