#!/usr/bin/env bash
# Set up ubep on a fresh machine: Open MPI (for the bench's MPI row), a virtual
# environment with torch (CPU build) and ubep with its test tools and NIXL (fabric="nixl").
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v mpicc >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing Open MPI from Debian's packages"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
    else
        echo "setup: Open MPI not found and cannot be installed here; 'ubep bench' will skip its mpi row"
    fi
fi
quiet_pip() {  # pip, minus the notices about index locations this machine's pip config names
    .venv/bin/pip "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
}
python3 -m venv .venv
quiet_pip install -q --upgrade pip
quiet_pip install -q torch==2.13.0
extras="dev,bench,fast,device,frameworks,observe,nixl"  # nixl: the nixl-cu12 wheel, 68 MB, no CUDA needed
command -v mpicc >/dev/null 2>&1 && extras="$extras,mpi"
quiet_pip install -q -e ".[$extras]"
.venv/bin/ubep warm  # numba's kernels compiled once for this host, so that no Buffer compiles them
echo "setup: done ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
