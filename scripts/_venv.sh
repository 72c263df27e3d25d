# Sourced by scripts/serve and scripts/test: creates or reuses .venv and installs the project.
# Re-installs only when pyproject.toml changed (stamp file holds its hash).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${HIPFIRE_VENV:-$root/.venv}"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)-${1:-base}"
stamp="$venv/.hipfire-installed"
if [ ! -f "$stamp" ] || ! grep -qx "$want" "$stamp"; then
  "$venv/bin/python" -m pip install -q --upgrade pip
  # A pinned CPU-capable torch first: an unpinned one would pull a multi-GB CUDA build.
  # On a GPU machine, install the torch build for your accelerator before running this.
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    "$venv/bin/python" -m pip install -q "torch==${HIPFIRE_TORCH_VERSION:-2.13.0}"
  fi
  extra=""
  [ "${1:-base}" = "test" ] && extra="[test]"
  "$venv/bin/python" -m pip install -q -e "$root$extra"
  echo "$want" >> "$stamp"
fi
export PATH="$venv/bin:$PATH"
