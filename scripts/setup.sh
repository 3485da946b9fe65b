#!/usr/bin/env bash
# Set up ubep on a fresh machine: Open MPI (for the bench's MPI row), a virtual environment with
# torch (CPU build) and ubep with its test tools, pyzmq (fabric="zmq") and NIXL (fabric="nixl"), and
# numba's kernels compiled once for this host. Each step says what it does and, when done, how long
# it took: the installs and the compile take a minute or more each, with nothing else to show.
set -euo pipefail
cd "$(dirname "$0")/.."
begun=$SECONDS
say() { echo "setup: $* ($((SECONDS - begun)) s)"; }
quiet_pip() {  # pip, minus the notices about index locations this machine's pip config names
    .venv/bin/pip "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
}
if ! command -v mpicc >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "1/6 installing Open MPI from Debian's packages (apt-get: openmpi-bin, libopenmpi-dev)"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
    else
        say "1/6 Open MPI not found and cannot be installed here; 'ubep bench' will skip its mpi row"
    fi
else
    say "1/6 Open MPI is here ($(command -v mpicc))"
fi
say "2/6 creating the virtual environment .venv ($(python3 --version))"
python3 -m venv .venv
say "3/6 upgrading pip in .venv"
quiet_pip install -q --upgrade pip
say "4/6 installing torch 2.13.0 (the largest download: a minute or more)"
quiet_pip install -q torch==2.13.0
extras="dev,bench,fast,device,frameworks,observe,nixl,zmq"  # nixl: the nixl-cu12 wheel, 68 MB, no CUDA needed
command -v mpicc >/dev/null 2>&1 && extras="$extras,mpi"
say "5/6 installing ubep from this clone, editable, with the extras $extras"
quiet_pip install -q -e ".[$extras]"
say "6/6 compiling numba's kernels once for this host (ubep warm: a minute or two the first time)"
.venv/bin/ubep warm  # so that no Buffer compiles them
say "done: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'); run ubep as .venv/bin/ubep, or 'source .venv/bin/activate' first"
