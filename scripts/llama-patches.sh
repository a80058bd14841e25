# Sourced by scripts/install-llama-cpp.sh and benchmarks/build-llama-server.sh: the extra llama.cpp
# patches named in LLAMA_PATCHES ("file ...", relative to the working directory or the repository
# root $1), as absolute paths in the array `extra_patches`; a name that is no file stops the caller.
extra_patches=()
for p in ${LLAMA_PATCHES:-}; do
  [ -f "$p" ] || p="$1/$p"
  [ -f "$p" ] || { echo "LLAMA_PATCHES: no such file: $p" >&2; exit 2; }
  extra_patches+=("$(cd "$(dirname "$p")" && pwd)/$(basename "$p")")
done
