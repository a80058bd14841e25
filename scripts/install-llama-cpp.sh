#!/usr/bin/env bash
# Build and install llama-cpp-python for one ggml backend, cached by build flags.
#
# pip caches built wheels by package version only, so a CPU wheel would be silently
# reused for a Vulkan or CUDA request.  We build with --no-cache-dir into our own
# cache directory keyed by (version, backend, CMake flags, Python, machine) and
# install from there.
#
# Several builds side by side: `scripts/install-llama-cpp.sh vulkan,cpu` installs the first as the
# package and unpacks the native libraries of the others into
# ${XDG_DATA_HOME:-~/.local/share}/llm-gateway/llama-builds/<backend>-<version>-<key>/, where the
# gateway finds them and serves each model from the build that fits its engine, each in its own
# worker process (LLAMA_CPP_LIB_PATH).
#
# usage: scripts/install-llama-cpp.sh [cpu|vulkan|cuda|metal][,more...] [python]
set -euo pipefail

backends="${1:-cpu}"
python="${2:-python3}"
pinned_version=0.3.36
pinned_sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
version="${LLAMA_CPP_PYTHON_VERSION:-$pinned_version}"
root="$(cd "$(dirname "$0")/.." && pwd)"
cache_root="${GATEWAY_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-gateway/wheels}"

build_one() {
  local backend="$1"
  # Components we never use from Python; skipping them shortens the build.
  common="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF"
  case "$backend" in
    cpu)    flags="" ;;
    vulkan)
      # Build tools and loader from Debian; headers new enough for ggml (see vulkan-headers.sh).
      if ! command -v glslc >/dev/null || [ ! -e /usr/include/vulkan/vulkan.h ] || [ ! -d /usr/include/spirv ]; then
        if command -v apt-get >/dev/null; then
          apt-get install -y --no-install-recommends libvulkan-dev glslc glslang-tools spirv-headers >&2 \
            || { apt-get update >&2 && apt-get install -y --no-install-recommends libvulkan-dev glslc glslang-tools spirv-headers >&2; }
        else
          echo "the Vulkan build needs the Vulkan SDK (loader, headers, glslc); install it first" >&2; exit 2
        fi
      fi
      vk_include="${VULKAN_INCLUDE_DIR:-$(bash "$(dirname "$0")/vulkan-headers.sh")}"
      flags="-DGGML_VULKAN=on -DVulkan_INCLUDE_DIR=$vk_include ${VULKAN_CMAKE_ARGS:-}" ;;
    cuda)   flags="-DGGML_CUDA=on ${CUDA_CMAKE_ARGS:-}" ;;
    metal)  flags="-DGGML_METAL=on" ;;
    *) echo "unknown backend '$backend' (expected cpu, vulkan, cuda or metal)" >&2; exit 2 ;;
  esac
  # GGML_NATIVE (the default) tunes for this CPU only; set GGML_PORTABLE=1 for a wheel
  # meant to run on another machine.
  if [ "${GGML_PORTABLE:-0}" = "1" ]; then flags="$flags -DGGML_NATIVE=off"; fi
  cmake_args="$common $flags ${EXTRA_CMAKE_ARGS:-}"

  pyver="$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
  cpu_sig="$(grep -m1 -E '^flags' /proc/cpuinfo 2>/dev/null | md5sum | cut -c1-8 || echo any)"
  key="$(printf '%s|%s|%s|%s|%s|%s' "$version" "$backend" "$cmake_args" "$pyver" "$(uname -m)" "$cpu_sig" | sha256sum | cut -c1-16)"
  dir="$cache_root/$backend-$version-$key"

  if ! ls "$dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $version for $backend (flags: $cmake_args) into $dir" >&2
    tmp="$dir.tmp.$$"
    mkdir -p "$tmp"
    # The sdist is checked against its pinned hash, and built with the pinned build tools of
    # requirements/build.txt instead of whatever build isolation would resolve today.
    req="$tmp/llama-cpp-python.req"
    if [ "$version" = "$pinned_version" ]; then
      echo "llama-cpp-python==$version --hash=sha256:$pinned_sha256" > "$req"
    else
      echo "llama-cpp-python==$version" > "$req"   # an explicitly requested other version: unpinned
    fi
    "$python" -m pip install -q --require-hashes -r "$root/requirements/build.txt"
    CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
      "$python" -m pip wheel --no-deps --no-cache-dir --no-build-isolation --no-binary llama-cpp-python \
        -w "$tmp" -r "$req"
    rm -f "$req"
    rm -rf "$dir"; mv "$tmp" "$dir"
    printf '%s\n' "$cmake_args" > "$dir/CMAKE_ARGS"
  else
    echo "using cached $backend build in $dir" >&2
  fi
}

builds_root="${GATEWAY_LLAMA_BUILDS:-${XDG_DATA_HOME:-$HOME/.local/share}/llm-gateway/llama-builds}"
IFS=, read -ra wanted <<< "$backends"
first=1
for backend in "${wanted[@]}"; do
  build_one "$backend"
  if [ "$first" = 1 ]; then
    "$python" -m pip install --no-deps --force-reinstall "$dir"/llama_cpp_python-*.whl
    first=0
  else
    target="$builds_root/$(basename "$dir")"
    if [ ! -e "$target/libllama.so" ] && [ ! -e "$target/libllama.dylib" ]; then
      mkdir -p "$target.tmp.$$"
      "$python" - "$dir" "$target.tmp.$$" <<'PY'
import pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("llama_cpp_python-*.whl"))
out = pathlib.Path(sys.argv[2])
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith("llama_cpp/lib/") and not name.endswith("/"):
            (out / pathlib.PurePosixPath(name).name).write_bytes(z.read(name))
PY
      rm -rf "$target"; mv "$target.tmp.$$" "$target"
      cp "$dir/CMAKE_ARGS" "$target/" 2>/dev/null || true
    fi
    echo "$backend build side by side in $target" >&2
  fi
done
# Its pure-Python dependencies (typing-extensions, numpy, diskcache, jinja2) come pinned with
# hashes from the lock files that scripts/setup.sh installs next.
