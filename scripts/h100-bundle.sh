#!/usr/bin/env bash
# Makes the git-ignored bundles that scripts/h100-prefix.sh and h100-speed.sh carry to the lent H100
# (CUDA 13, Python 3.12, no package registry), each call under 64 MiB:
#   .whl/    cp312 wheels of requirements/serve.txt (hash-checked against the lock) but numpy and hf-xet
#   .dev28/  llama-src-tools.tar.gz: the pinned llama-cpp-python sdist (hash-checked) without docs,
#            tests, other backends' sources and vocab files, but with llama-server, llama-quantize,
#            gguf-py and models/ggml-vocab-llama-bpe.gguf (Llama 3's tokenizer and hyperparameters)
# Idempotent: what exists is kept. Needs the package registry (run here, not there).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
grep -qx "/.dev28/" .git/info/exclude 2>/dev/null || echo "/.dev28/" >> .git/info/exclude
if [ ! -e .whl/.complete ]; then
  rm -rf .whl && mkdir -p .whl
  python3 -m pip download -q --no-deps --only-binary=:all: --require-hashes --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl -r requirements/serve.txt
  # The machine has numpy and hf-xet (its image's versions serve): 21 MiB less to carry.
  rm -f .whl/numpy-*.whl .whl/hf_xet-*.whl
  touch .whl/.complete
fi
if [ ! -s .dev28/llama-src-tools.tar.gz ]; then
  sum=$(sed -n 's/^pinned_sha256=//p' scripts/install-llama-cpp.sh)
  ver=$(sed -n 's/^pinned_version=//p' scripts/install-llama-cpp.sh)
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  echo "llama-cpp-python==$ver --hash=sha256:$sum" > "$tmp/req.txt"
  python3 -m pip download -q --no-deps --no-cache-dir --no-binary :all: --require-hashes -d "$tmp/sd" -r "$tmp/req.txt"
  mkdir -p "$tmp/x" && tar xzf "$tmp"/sd/*.tar.gz -C "$tmp/x"
  s=$(echo "$tmp"/x/*)
  v="$s/vendor/llama.cpp"
  rm -rf "$s/docs" "$s/tests" "$v/docs" "$v/tests" "$v/benches" "$v/media"
  find "$v/models" -mindepth 1 ! -name ggml-vocab-llama-bpe.gguf -exec rm -rf {} +
  for b in et metal hexagon sycl vulkan opencl cann musa hip kompute webgpu zdnn rpc virtgpu; do rm -rf "$v/ggml/src/ggml-$b"; done
  mkdir -p .dev28 && tar czf .dev28/llama-src-tools.tar.gz -C "$tmp/x" "$(basename "$s")"
fi
du -sh .whl .dev28
