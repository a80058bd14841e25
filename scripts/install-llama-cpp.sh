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
#   LLAMA_PATCHES="file ..."  more patches (-p1 on the sdist's tree) after scripts/patches/, e.g.
#                             benchmarks/patches/ggml-cuda-green-contexts.patch; part of the cache key
#   LLAMA_CPP_SDIST=file      a local copy of the sdist (checked against the pinned hash) instead of
#                             downloading it; with PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR (the wheels of
#                             requirements/build.txt in DIR) nothing is fetched (scripts/offline-bundle.sh)
set -euo pipefail

backends="${1:-cpu}"
python="${2:-python3}"
pinned_version=0.3.36
pinned_sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
version="${LLAMA_CPP_PYTHON_VERSION:-$pinned_version}"
root="$(cd "$(dirname "$0")/.." && pwd)"
. "$root/scripts/llama-patches.sh" "$root"
cache_root="${GATEWAY_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llm-gateway/wheels}"

build_one() {
  local backend="$1"
  # Components we never use from Python; skipping them shortens the build.
  # --exclude-libs: some toolchains link parts of libstdc++ statically into the libraries (CUDA 13's
  # into libggml-cuda; an Ubuntu 24.04 host's g++ 13 into every one, the CPU-only build too);
  # exported, they interpose on the system libstdc++ inside Python and the model load segfaults
  # (docs/benchmarks.md#if-the-gateways-worker-dies-while-loading).
  common="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAVA_BUILD=ON -DLLAMA_CURL=OFF"
  common="$common -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL"
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
  # On x86-64 Linux every build carries its CPU backend as loadable variants (ggml's
  # GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS, as llama.cpp's own releases ship it): one wheel runs
  # on any x86-64 host, and the gateway loads the variant it chooses (engines/llamacpp/ggml_backends.py):
  # the fastest the CPU supports, except AMX (its kernel segfaults, README "CPUs"), with a lower
  # one to fall back on. GGML_CPU_VARIANTS (our patch) trims the list to the ones worth their
  # build time: baseline x86-64, SSE4.2, AVX2, AVX-512, AVX-512 VNNI/VBMI, +BF16, +AMX.
  # Modules install beside libllama (CMAKE_INSTALL_BINDIR), where the gateway looks for them.
  # GGML_NATIVE=1 builds for this CPU only, as before.
  if [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] && [ "${GGML_NATIVE:-0}" != "1" ]; then
    flags="$flags -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DCMAKE_INSTALL_BINDIR=llama_cpp/lib"
    flags="$flags -DGGML_CPU_VARIANTS=${GGML_CPU_VARIANTS:-x64,sse42,haswell,skylakex,icelake,zen4,sapphirerapids}"
  fi
  cmake_args="$common $flags ${EXTRA_CMAKE_ARGS:-}"

  pyver="$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
  # A native build is for this CPU only: its key names the CPU. The patches are part of the key.
  cpu_sig=any
  case "$cmake_args" in *GGML_BACKEND_DL=ON*) ;; *) cpu_sig="$(grep -m1 -E '^flags' /proc/cpuinfo 2>/dev/null | md5sum | cut -c1-8 || echo any)" ;; esac
  patch_sig="$(cat "$root/scripts/patches/llama-cpp-python-$version"/*.patch ${extra_patches[@]+"${extra_patches[@]}"} 2>/dev/null | sha256sum | cut -c1-8)"
  key="$(printf '%s|%s|%s|%s|%s|%s|%s' "$version" "$backend" "$cmake_args" "$pyver" "$(uname -m)" "$cpu_sig" "$patch_sig" | sha256sum | cut -c1-16)"
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
    # The sdist (hash-checked), unpacked, with our patches (scripts/patches/<package>-<version>/).
    hashes=""; [ "$version" = "$pinned_version" ] && hashes="--require-hashes"
    if [ -n "${LLAMA_CPP_SDIST:-}" ]; then
      sum="$(sha256sum < "$LLAMA_CPP_SDIST" | cut -d' ' -f1)"
      if [ -n "$hashes" ] && [ "$sum" != "$pinned_sha256" ]; then
        echo "$LLAMA_CPP_SDIST: sha256 $sum, not the pinned $pinned_sha256" >&2; exit 2
      fi
      mkdir -p "$tmp/sdist" && cp "$LLAMA_CPP_SDIST" "$tmp/sdist/llama_cpp_python-$version.tar.gz"
    else
      "$python" -m pip download -q --no-deps --no-cache-dir --no-binary :all: $hashes -d "$tmp/sdist" -r "$req"
    fi
    mkdir -p "$tmp/src"
    tar xzf "$tmp"/sdist/llama_cpp_python-*.tar.gz -C "$tmp/src" --strip-components=1
    for p in "$root/scripts/patches/llama-cpp-python-$version"/*.patch ${extra_patches[@]+"${extra_patches[@]}"}; do
      [ -e "$p" ] || continue
      echo "applying $(basename "$p")" >&2
      patch -s -p1 -d "$tmp/src" < "$p"
    done
    CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
      "$python" -m pip wheel --no-deps --no-cache-dir --no-build-isolation -w "$tmp" "$tmp/src"
    # llama.cpp's Hugging Face converter of this version, kept for scripts/tiny_vlm.py (the test
    # vision model is converted the way a real one is).
    convert="${XDG_CACHE_HOME:-$HOME/.cache}/llm-gateway/llama-convert-$version"
    if [ ! -e "$convert/convert_hf_to_gguf.py" ]; then
      rm -rf "$convert.part" && mkdir -p "$convert.part"
      (cd "$tmp/src/vendor/llama.cpp" && cp -r convert_hf_to_gguf.py conversion gguf-py "$convert.part/")
      rm -rf "$convert" && mv "$convert.part" "$convert"
    fi
    rm -rf "$req" "$tmp/src" "$tmp/sdist"
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
