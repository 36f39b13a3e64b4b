#!/usr/bin/env bash
# Virtual environments for the third-party benchmark clients that bench/third_party/run.py drives
# against our gateway. They live here, out of the project's dependencies: vLLM pins a CUDA torch and
# ~70 GPU packages, and aiperf ~130 packages we do not otherwise need.
#
#   .venv-vllm    `vllm bench serve`: torch==2.13.0 (the local CPU wheel; never unpinned, that pulls
#                 GBs of CUDA), `pip install --no-deps vllm`, then only what `vllm bench serve`
#                 imports, found by running `vllm bench serve --help` and fixing ImportErrors one by one
#                 (pandas: the `custom` dataset). xgrammar goes in without its dependencies: it would
#                 pull triton, which the CPU benchmark client never touches.
#   .venv-aiperf  NVIDIA's aiperf (guidellm is the other candidate; aiperf installs from wheels with no
#                 torch and drives image requests on CPU, so it is the one used).
#
# Versions that worked (2026-11, Python 3.11.7): vllm 0.33.0 on torch 2.13.0+cpu with transformers
# 5.20.2, fastapi 0.136.3, openai 3.54.0, xgrammar 0.2.8 llguidance 1.7.6 (others as pinned below); aiperf 0.13.0.
# vLLM 0.33.0 asks for torch 2.14.0; its benchmark client runs on 2.13.0 (it only imports torch).
#
# Idempotent: a venv whose tool already starts is left alone. Delete a venv to rebuild it.
# Usage: bash bench/third_party/setup.sh
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3.11}"
VLLM_VENV="$HERE/.venv-vllm"
AIPERF_VENV="$HERE/.venv-aiperf"
PIP_FLAGS=(-q --disable-pip-version-check)

VLLM_VERSION=0.33.0
AIPERF_VERSION=0.13.0
# What `vllm bench serve` imports (pure Python or plain binary wheels; no CUDA), pinned as tested.
VLLM_CLIENT_DEPS=(
  aiohttp==3.14.5 cachetools==8.0.1 cbor2==6.2.1 cloudpickle==3.1.2 einops==0.8.2
  fastapi==0.136.3 huggingface-hub==2.4.0 llguidance==1.7.6 msgspec==0.22.0 numpy==2.4.6
  openai==3.54.0 openai-harmony==0.0.8 orjson==3.13.0 packaging==26.3 pandas==3.1.1
  partial-json-parser==0.2.1.1.post7 pillow==13.0.0 prometheus-client==0.26.0 psutil==7.2.2
  py-cpuinfo==9.0.0 pybase64==1.5.1 pydantic==2.14.3 pyyaml==6.0.3 pyzmq==27.3.0
  regex==2026.11.15 requests==2.34.2 transformers==5.20.2 urllib3==2.8.0 uvicorn==0.54.0
  uvloop==0.23.0 watchfiles==1.3.0
)
XGRAMMAR=(xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2)  # installed with --no-deps (no triton)

constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
# torch stays the CPU build whatever a dependency asks for.
printf 'torch==2.13.0\n' >"$constraints"

# pip's resolver lists every vLLM dependency left out on purpose (CUDA kernels, torchvision, ...):
# expected, and drowns real errors, so those lines are dropped; pip's exit status still counts.
pip_install() {
  "$@" 2>&1 | sed -e "/^vllm [0-9.]* requires /d" -e "/pip's dependency resolver/d" \
    -e "/^WARNING: Location /d"
}

make_venv() {
  [[ -x "$1/bin/python" ]] || "$PYTHON" -m venv "$1"
}

setup_vllm() {
  if "$VLLM_VENV/bin/vllm" bench serve --help >/dev/null 2>&1; then
    echo "vllm: $VLLM_VENV ready"
    return
  fi
  echo "vllm: building $VLLM_VENV"
  make_venv "$VLLM_VENV"
  local pip=(pip_install "$VLLM_VENV/bin/pip" install "${PIP_FLAGS[@]}" -c "$constraints")
  "${pip[@]}" torch==2.13.0
  "${pip[@]}" --no-deps "vllm==$VLLM_VERSION"
  "${pip[@]}" "${VLLM_CLIENT_DEPS[@]}"
  "${pip[@]}" --no-deps "${XGRAMMAR[@]}"
  "$VLLM_VENV/bin/vllm" bench serve --help >/dev/null 2>&1 || {
    "$VLLM_VENV/bin/vllm" bench serve --help 2>&1 | tail -5
    exit 1
  }
  echo "vllm: $("$VLLM_VENV/bin/pip" show vllm 2>/dev/null | sed -n 's/^Version: //p') ready"
}

setup_aiperf() {
  if "$AIPERF_VENV/bin/aiperf" --version >/dev/null 2>&1; then
    echo "aiperf: $AIPERF_VENV ready"
    return
  fi
  echo "aiperf: building $AIPERF_VENV"
  make_venv "$AIPERF_VENV"
  pip_install "$AIPERF_VENV/bin/pip" install "${PIP_FLAGS[@]}" -c "$constraints" "aiperf==$AIPERF_VERSION"
  "$AIPERF_VENV/bin/aiperf" --version >/dev/null
  echo "aiperf: $AIPERF_VERSION ready"
}

setup_vllm
setup_aiperf
