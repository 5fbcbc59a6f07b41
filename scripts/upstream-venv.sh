#!/usr/bin/env bash
# Build a throwaway virtualenv holding upstream SGLang 0.5.13.post1 (CPU torch), for recording
# golden traces and measuring side by side. Never a project dependency.
# Usage: scripts/upstream-venv.sh [VENV_DIR]   (default: .venv-upstream)
# SGLANG_VERSION=0.5.23 scripts/upstream-venv.sh DIR builds one with a later release instead, for
# `uniradix bench --impl upstream,upstream-rust` (its Rust tree core, which the wheel ships
# prebuilt for Linux; 0.5.19 and 0.5.23 were measured); the conformance adapter and the golden
# corpus follow 0.5.13.post1.
set -euo pipefail
venv=${1:-.venv-upstream}
version=${SGLANG_VERSION:-0.5.13.post1}
py=${PYTHON:-python3}
# (a bare `import sglang` fails here: it imports torchvision, which the adapter stubs out)
# Mooncake's store (the same wheel as the project's `mooncake` extra; Linux x86_64 only), so
# `bench-storage` and tests/fast/storage/test_storage_sglang.py reach upstream's Mooncake backend
mooncake_pkg=""
[ "$(uname -s)-$(uname -m)" = Linux-x86_64 ] && mooncake_pkg="mooncake-transfer-engine-non-cuda>=0.3.13"
ready='import importlib.metadata as m; m.version("sglang"); m.version("pytest"); m.version("prometheus_client")'
[ -z "$mooncake_pkg" ] || ready="$ready; m.version(\"mooncake-transfer-engine-non-cuda\")"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "$ready" 2>/dev/null; then
  echo "upstream venv ready: $venv"; exit 0
fi
"$py" -m venv "$venv"
cons=$(mktemp)
echo "torch==2.13.0" > "$cons"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q torch==2.13.0
"$venv/bin/pip" install -q -c "$cons" --no-deps "sglang==$version"
"$venv/bin/pip" install -q -c "$cons" numpy orjson psutil pybase64 requests packaging triton pillow \
  starlette tqdm ipython pydantic aiohttp msgspec pyzmq transformers==5.8.1 openai \
  partial_json_parser dill sentencepiece einops compressed-tensors gguf
# the test runner, so the `upstream`-marked tests run inside this venv (pyproject's addopts need
# pytest-benchmark and pytest-timeout; tests/fast/test_metrics.py imports prometheus_client)
"$venv/bin/pip" install -q -c "$cons" pytest pytest-benchmark pytest-timeout hypothesis prometheus_client
# (it links against the system library libibverbs1: `make ibverbs` installs that)
[ -z "$mooncake_pkg" ] || "$venv/bin/pip" install -q -c "$cons" "$mooncake_pkg"
# later releases import xgrammar at module level (transformers stays at 5.8.1: the torchvision
# placeholder of conformance/adapters/upstream.py satisfies it)
[ "$version" = 0.5.13.post1 ] || "$venv/bin/pip" install -q -c "$cons" xgrammar
# this project's own package too, so the adapter and recorder run inside it
[ -f pyproject.toml ] && "$venv/bin/pip" install -q -c "$cons" --no-deps -e .
rm -f "$cons"
echo "upstream venv ready: $venv"
