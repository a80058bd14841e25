#!/usr/bin/env bash
# Build ExecuTorch's Vulkan backend for the installed executorch wheel.
#
#   bash scripts/install-executorch.sh vulkan      -> prints the built library's path
#
# The PyPI wheel (the `executorch` extra) runs XNNPACK programs but has no Vulkan runtime, and
# there is no sdist.  The wheel does ship its runtime as shared libraries with its headers and a
# CMake package, so this builds only the Vulkan backend, from pinned source snapshots, into
# libexecutorch_backend_vulkan.so linked against the wheel's libexecutorch.so
# (scripts/executorch-vulkan/CMakeLists.txt).  The engine loads it before a Vulkan program; its
# static initialiser registers "VulkanBackend" with the wheel's runtime.  Beside it,
# libgateway_et_runner.so (runner.cpp): the engine runs Vulkan programs through it, without torch.
#
# Sources (no package registry carries them; each is checked to be the pinned commit), first found of:
#   1. EXECUTORCH_SRC (an ExecuTorch checkout at $ET_COMMIT) or EXECUTORCH_GIT, and VOLK_GIT,
#      VMA_GIT: local git dirs (bare or not) holding the pinned commits, e.g. on an air-gapped host;
#   2. the same variables in ${XDG_CONFIG_HOME:-~/.config}/llm-gateway/executorch-sources
#      (KEY=VALUE lines), for a machine that keeps such copies;
#   3. the upstream repositories on GitHub, fetched once into
#      ${XDG_CACHE_HOME:-~/.cache}/llm-gateway/sources/ (only the pinned commits).
# Where none of them has a pinned commit the build is not possible: this exits 3 saying what to
# set, and the tests of Vulkan programs skip with that reason.
# Tools from Debian: glslc, flatc (flatbuffers-compiler 2.0.8, with its headers), cmake, ninja;
# Vulkan headers from scripts/vulkan-headers.sh (as the llama.cpp Vulkan build).
#
# Shaders that need a GLSL extension this glslc lacks (bookworm's glslc has neither
# GL_EXT_integer_dot_product nor GL_KHR_cooperative_matrix) are left out and listed in build.json:
# they are int8-activation and cooperative-matrix kernels, which fp32 and weight-only programs do
# not use; the runtime names a missing shader if a program ever asks for one.
#
# Cached by what decides the binary: executorch version, source commits, glslc, compiler, flags.
# Output: ${XDG_CACHE_HOME:-~/.cache}/llm-gateway/executorch-vulkan/<key>/ with build.json.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
[ "${1:-}" = vulkan ] || { echo "usage: $0 vulkan" >&2; exit 2; }

ET_COMMIT=cff6f4dd32e630945b7188512c1f2b4f102b05ad    # main, 2026-08-22 (the 1.5 line; schema.fbs as 1.5.1's)
VOLK_COMMIT=91e0d29e4d328328be05290eb02e80660c6eca95
VMA_COMMIT=e386068d174c9807479b4d13ff2db8e23bd91bc0
config="${XDG_CONFIG_HOME:-$HOME/.config}/llm-gateway/executorch-sources"
if [ -f "$config" ]; then  # KEY=VALUE lines; the environment wins
  while IFS='=' read -r k v; do
    case "$k" in EXECUTORCH_SRC|EXECUTORCH_GIT|VOLK_GIT|VMA_GIT) [ -n "${!k:-}" ] || export "$k=$v" ;; esac
  done < <(grep -E '^[A-Z_]+=' "$config")
fi
sources="${XDG_CACHE_HOME:-$HOME/.cache}/llm-gateway/sources"
py="${PYTHON:-$root/.venv/bin/python}"
CXXFLAGS_ET="${EXECUTORCH_VULKAN_CXXFLAGS:--O2}"

et_pkg="$("$py" -c 'import importlib.util; s = importlib.util.find_spec("executorch"); print(next(iter(s.submodule_search_locations)) if s else "")')"
[ -n "$et_pkg" ] || { echo "executorch is not installed in $py (pip install -e '.[executorch]')" >&2; exit 2; }
et_version="$("$py" -c 'import importlib.metadata as m; print(m.version("executorch"))')"

need=()
command -v glslc >/dev/null || need+=(glslc)
command -v flatc >/dev/null || need+=(flatbuffers-compiler)
[ -e /usr/include/flatbuffers/flatbuffers.h ] || need+=(libflatbuffers-dev)
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v c++ >/dev/null || need+=(g++)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi
vk_include="${VULKAN_INCLUDE_DIR:-$(bash scripts/vulkan-headers.sh)}"

key_text="executorch=$et_version et=$ET_COMMIT volk=$VOLK_COMMIT vma=$VMA_COMMIT glslc=$(glslc --version | head -1)
flatc=$(flatc --version) cxx=$(c++ --version | head -1) flags=$CXXFLAGS_ET vulkan=$(sed -n 's/^#define VK_HEADER_VERSION \([0-9]*\).*/\1/p' "$vk_include/vulkan/vulkan_core.h")
recipe=$(cat scripts/executorch-vulkan/* "$0" | sha256sum | cut -c1-16)"
key="$et_version-$(printf '%s' "$key_text" | sha256sum | cut -c1-12)"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/llm-gateway/executorch-vulkan"
out="$cache/$key"
lib="$out/libexecutorch_backend_vulkan.so"
if [ -f "$out/build.json" ] && [ -f "$lib" ]; then
  echo "ExecuTorch Vulkan backend: cached ($out)" >&2
  echo "$lib"; exit 0
fi

# The pinned sources, from a checkout or a git dir; anything else is a clear stop.
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
src="$work/src"; mkdir -p "$src/executorch" "$work/volk" "$work/vma"
upstream() {  # name url commit -> a git dir holding the commit (fetched once), or "" when unreachable
  local g="$sources/$1.git"
  [ -d "$g" ] || git init -q --bare "$g"
  if ! git --git-dir="$g" cat-file -e "$3^{commit}" 2>/dev/null; then
    GIT_TERMINAL_PROMPT=0 timeout 300 git --git-dir="$g" fetch -q --depth 1 "$2" "$3" >&2 2>/dev/null || true
  fi
  git --git-dir="$g" cat-file -e "$3^{commit}" 2>/dev/null && echo "$g" || true
}
from_git() {  # git-dir commit dest paths...
  local g="$1" c="$2" d="$3"; shift 3
  if [ -z "$g" ] || ! git --git-dir="$g" cat-file -e "$c^{commit}" 2>/dev/null; then
    echo "no source of commit $c: ${g:-its upstream repository is not reachable from here}" >&2
    echo "the ExecuTorch Vulkan backend cannot be built without its pinned sources (no package registry" \
         "carries them): set EXECUTORCH_GIT, VOLK_GIT and VMA_GIT to git dirs holding them, here or in $config" >&2
    exit 3
  fi
  git --git-dir="$g" archive "$c" "$@" | tar x -C "$d"
}
mkdir -p "$sources"
[ -n "${EXECUTORCH_SRC:-}${EXECUTORCH_GIT:-}" ] || EXECUTORCH_GIT="$(upstream executorch https://github.com/pytorch/executorch.git "$ET_COMMIT")"
[ -n "${VOLK_GIT:-}" ] || VOLK_GIT="$(upstream volk https://github.com/zeux/volk.git "$VOLK_COMMIT")"
[ -n "${VMA_GIT:-}" ] || VMA_GIT="$(upstream vma https://github.com/GPUOpen-LibrariesAndSDKs/VulkanMemoryAllocator.git "$VMA_COMMIT")"
if [ -n "${EXECUTORCH_SRC:-}" ]; then
  got="$(git -C "$EXECUTORCH_SRC" rev-parse HEAD 2>/dev/null || true)"
  [ "$got" = "$ET_COMMIT" ] || { echo "EXECUTORCH_SRC is at '${got:-not a git checkout}', not $ET_COMMIT" >&2; exit 3; }
  cp -r "$EXECUTORCH_SRC/backends" "$src/executorch/"
else
  from_git "$EXECUTORCH_GIT" "$ET_COMMIT" "$src/executorch" backends/vulkan/runtime backends/vulkan/serialization LICENSE
fi
from_git "$VOLK_GIT" "$VOLK_COMMIT" "$work/volk" volk.c volk.h LICENSE.md
from_git "$VMA_GIT" "$VMA_COMMIT" "$work/vma" include LICENSE.txt

start=$(date +%s)
vk="$src/executorch/backends/vulkan"
# 1. Shaders: template expansion and glslc, into one spv.cpp (ExecuTorch's own generator).
"$py" scripts/executorch-vulkan/shaders.py "$vk/runtime/graph/ops/glsl" "$work/glsl" "$(command -v glslc)" > "$work/shaders.json"
"$py" "$vk/runtime/gen_vulkan_spv.py" --glsl-path "$work/glsl" --output-path "$work/spv" \
  --glslc-path="$(command -v glslc)" --tmp-dir-path="$work/spv-cache" --optimize --nthreads "$(nproc)" > "$work/spv.log" 2>&1 \
  || { grep -v '^template_file_path' "$work/spv.log" | tail -20 >&2; exit 1; }
shaders_s=$(( $(date +%s) - start ))
# 2. The delegate's flatbuffer schema.
mkdir -p "$work/schema/executorch/backends/vulkan/serialization"
flatc --cpp --cpp-std c++11 --scoped-enums -o "$work/schema/executorch/backends/vulkan/serialization/" "$vk/serialization/schema.fbs"
# 3. The library.
cmake -S scripts/executorch-vulkan -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CXX_FLAGS_RELEASE="$CXXFLAGS_ET -DNDEBUG" -DCMAKE_C_FLAGS_RELEASE="$CXXFLAGS_ET -DNDEBUG" \
  -DET_SOURCE="$src" -DET_PACKAGE="$et_pkg" -DVULKAN_HEADERS="$vk_include" -DVOLK_DIR="$work/volk" \
  -DVMA_DIR="$work/vma" -DSPV_CPP="$work/spv/spv.cpp" -DSCHEMA_INCLUDE="$work/schema" > "$work/cmake.log" 2>&1 \
  || { tail -20 "$work/cmake.log" >&2; exit 1; }
ninja -C "$work/build" > "$work/ninja.log" 2>&1 || { grep -m5 -A5 'error' "$work/ninja.log" >&2; exit 1; }
total_s=$(( $(date +%s) - start ))

rm -rf "$out.tmp"; mkdir -p "$out.tmp"
cp "$work/build/libexecutorch_backend_vulkan.so" "$work/build/libgateway_et_runner.so" "$out.tmp/"
cp "$src/executorch/LICENSE" "$out.tmp/LICENSE.executorch" 2>/dev/null || true
KEY_TEXT="$key_text" SHADERS="$work/shaders.json" SHADERS_S="$shaders_s" TOTAL_S="$total_s" ET_VERSION="$et_version" \
  ET_COMMIT="$ET_COMMIT" "$py" - "$out.tmp/build.json" <<'EOF'
import json, os, sys
shaders = json.load(open(os.environ["SHADERS"]))
json.dump({"executorch_version": os.environ["ET_VERSION"], "source_commit": os.environ["ET_COMMIT"],
           "key": os.environ["KEY_TEXT"], "shader_seconds": int(os.environ["SHADERS_S"]),
           "build_seconds": int(os.environ["TOTAL_S"]), "cores": os.cpu_count(), **shaders},
          open(sys.argv[1], "w"), indent=1)
EOF
rm -rf "$out"; mv "$out.tmp" "$out"
echo "ExecuTorch Vulkan backend built in ${total_s}s (shaders ${shaders_s}s): $out" >&2
echo "$lib"
