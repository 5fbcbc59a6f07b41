#!/usr/bin/env bash
# Download, on a machine with network, the wheels that let sglang 0.5.13.post1's cache import on
# the GPU machines (Python 3.12, CUDA torch and triton installed, no network, no sglang), so
# scripts/gpu-bench.sh --wheels DIR measures upstream beside fast there. About 40 MB: sglang and
# the packages it imports at module level that those machines lack, at the versions the upstream
# venv (scripts/upstream-venv.sh) tests, transformers 5.8.1 included (their 5.17 is untested with
# the adapter's torchvision placeholder). sgl_kernel is not among them: its CUDA wheels are large,
# and the adapter stands a placeholder in for it (conformance/adapters/upstream.py).
# Usage: scripts/gpu-wheels.sh [DIR]   (default .whl; PYTHON_VERSION=3.12 for another target)
set -euo pipefail
dir=${1:-.whl}
pyver=${PYTHON_VERSION:-3.12}
mkdir -p "$dir"
plat=()
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do plat+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
  --implementation cp "${plat[@]}" -d "$dir" \
  sglang==0.5.13.post1 transformers==5.8.1 tokenizers==0.22.2 typing_extensions==4.16.0 \
  msgspec==0.23.0 pyzmq==27.3.0 orjson==3.13.0 pybase64==1.5.1 pydantic==2.14.4 \
  pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5 starlette==1.10.0 \
  dill==0.4.1 gguf==0.19.0 compressed-tensors==0.20.1 openai==3.60.0 jiter==0.19.0 distro==1.9.0 \
  sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
  partial_json_parser==0.2.1.1.post7 loguru==0.7.3 ipython==9.18.1 traitlets==5.16.1 \
  decorator==5.3.1 jedi==0.20.1 parso==0.8.7 matplotlib-inline==0.2.2 pexpect==4.9.0 \
  prompt_toolkit==3.0.53 stack_data==0.6.3 asttokens==3.0.2 executing==2.3.0 pure_eval==0.2.4 \
  wcwidth==0.9.4 ptyprocess==0.7.0 ipython_pygments_lexers==1.1.1
echo "gpu-wheels: $(ls "$dir"/*.whl | wc -l) wheels, $(du -sh "$dir" | cut -f1), in $dir"
