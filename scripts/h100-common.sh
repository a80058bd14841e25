# Sourced by scripts/h100-*.sh: the set-up they share on the lent H100 (CUDA 13, Python 3.12, no
# package registry). $W is the script's work folder; what the machine lacks travels in git-ignored
# folders: .whl/ (cp312 wheels of requirements/serve.txt) and .dev28/llama-src-tools.tar.gz (the
# pinned llama-cpp-python sdist with llama-server and the tools).

# h100_install: the wheels into $W/site, the llama.cpp source into $W/src.
h100_install() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$W/site" .whl/*.whl
  rm -rf "$W/src" && mkdir -p "$W/src" && tar xzf .dev28/llama-src-tools.tar.gz -C "$W/src" --strip-components=1
  # Patches of the CUDA build only (scripts/patches-h100/, e.g. CUDA stream priorities for
  # benchmarks/probe_two_contexts.py --priority); the wheels CI builds are not patched by them.
  for p in scripts/patches-h100/*.patch; do
    [ -e "$p" ] && patch -s -p1 -d "$W/src" < "$p" && echo "applied $(basename "$p")"
  done
}

# h100_build TARGET...: start the CUDA build of those targets in the background ($W/build.log ends
# with "EXIT <status>"); a later call waits for it with h100_wait_build.
h100_build() {
  cat > "$W/build.sh" <<EOS
set -e
cmake -S $W/src/vendor/llama.cpp -B $W/build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL
cmake --build $W/build --target $* -j 16
EOS
  setsid bash -c "time bash $W/build.sh > $W/build.log 2>&1; echo EXIT \$? >> $W/build.log" < /dev/null > /dev/null 2>&1 &
  echo "build started"; nvidia-smi -L; python3 --version; lscpu | grep -E "Model name|amx" | head -2
}

# h100_wait_build SECONDS: wait that long at most for the build; its log's tail.
h100_wait_build() {
  for _ in $(seq "$1"); do grep -q "^EXIT" "$W/build.log" 2>/dev/null && break; sleep 1; done
  tail -4 "$W/build.log"
}
