#!/usr/bin/env bash
# Build llama-server (and the shared libllama/libggml next to it) from the llama.cpp that
# llama-cpp-python vendors, so the gateway and llama-server are compared on the same code.
# Cached by (version, backend, flags, patches); never committed. Prints the bin directory.
#
# usage: benchmarks/build-llama-server.sh [cpu|cuda|vulkan]
#   LLAMA_SRC=dir-or-sdist.tar.gz   use this source instead of downloading the sdist from PyPI
#   LLAMA_PATCHES="file ..."        patches applied (-p1) to the sdist's tree, e.g.
#                                   benchmarks/patches/ggml-cuda-green-contexts.patch; part of the cache key
#   LLAMA_TARGETS="llama-quantize"  more targets to build into the same bin directory
#   CUDA_ARCH=90                    CUDA architectures (default: native)
set -euo pipefail
backend="${1:-cpu}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
cache="${GATEWAY_BUILD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-gateway/llama-server}"
flags="-DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_TYPE=Release"
case "$backend" in
  cpu) ;;
  cuda) flags="$flags -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-native}" ;;
  vulkan) flags="$flags -DGGML_VULKAN=ON -DVulkan_INCLUDE_DIR=$(bash "$(dirname "$0")/../scripts/vulkan-headers.sh")" ;;
  *) echo "unknown backend $backend" >&2; exit 2 ;;
esac
root="$(cd "$(dirname "$0")/.." && pwd)"
. "$root/scripts/llama-patches.sh" "$root"
key_in="$(printf '%s|%s|%s|%s' "$version" "$backend" "$flags" "$(uname -m)")"
[ ${#extra_patches[@]} -eq 0 ] || key_in="$key_in|$(cat "${extra_patches[@]}" | sha256sum | cut -c1-16)"
key="$(printf '%s' "$key_in" | sha256sum | cut -c1-12)"
dir="$cache/$backend-$version-$key"
targets="llama-server llama ${LLAMA_TARGETS:-}"
built=1
for t in $targets; do case "$t" in llama-*) [ -x "$dir/build/bin/$t" ] || built=0 ;; esac; done
if [ "$built" = 1 ]; then echo "$dir/build/bin"; exit 0; fi
mkdir -p "$dir"
src="${LLAMA_SRC:-}"
if [ -z "$src" ]; then
  python3 -m pip download -q --no-deps --no-binary :all: -d "$dir" "llama-cpp-python==$version" >&2
  src="$(ls "$dir"/llama_cpp_python-*.tar.gz)"
fi
if [ -f "$src" ]; then
  rm -rf "$dir/src"; mkdir -p "$dir/src"; tar xzf "$src" -C "$dir/src" --strip-components=1; src="$dir/src"
elif [ ${#extra_patches[@]} -gt 0 ]; then
  rm -rf "$dir/src"; cp -r "$src" "$dir/src"; src="$dir/src"  # patch a copy, not the given tree
fi
for p in ${extra_patches[@]+"${extra_patches[@]}"}; do
  echo "applying $(basename "$p")" >&2
  patch -s -p1 -d "$src" < "$p"
done
echo "building llama-server ($backend) from $src into $dir/build" >&2
# shellcheck disable=SC2086
cmake -S "$src/vendor/llama.cpp" -B "$dir/build" $flags >&2
# shellcheck disable=SC2086
cmake --build "$dir/build" --target $targets -j "${JOBS:-$(nproc)}" >&2
echo "$dir/build/bin"
