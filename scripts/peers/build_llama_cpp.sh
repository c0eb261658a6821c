#!/usr/bin/env bash
# Build llama.cpp, the CPU decoding peer of `scripts/benchmark.py --op decode --peer llama.cpp`
# (issue 29). Optional: nothing in the tests or the library needs it.
#
#   bash scripts/peers/build_llama_cpp.sh            # into third_party/llama.cpp (git-ignored)
#
# llama.cpp's source comes from the llama-cpp-python source package on the package registry
# (its vendor/llama.cpp), so that no git host is needed; LLAMA_CPP_PYTHON pins its version.
# Built for this CPU (GGML_NATIVE), without CURL, server or tests: llama-bench (speed),
# llama-batched-bench (batches of sequences decoded together), llama-quantize (q8_0 / q4_0) and
# llama-simple (greedy tokens, to check both engines agree).
# About 10-15 minutes on 2 cores. convert_hf_to_gguf.py stays in the source tree; the benchmark
# runs it with the source's gguf-py on the path (it needs torch and numpy, which the venv has).
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON:-0.3.36}"
DEST="${1:-third_party/llama.cpp}"
JOBS="${JOBS:-$(nproc)}"

mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
if [ ! -f "$DEST/src/CMakeLists.txt" ]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    python -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$tmp"
    tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
    rm -rf "$DEST/src"
    mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$DEST/src"
fi
cmake -S "$DEST/src" -B "$DEST/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON >"$DEST/cmake.log"
cmake --build "$DEST/build" -j "$JOBS" --target llama-bench llama-batched-bench llama-quantize llama-simple >"$DEST/build.log"
ls "$DEST/build/bin"
echo "llama.cpp $VERSION (from llama-cpp-python) built in $DEST/build/bin"
