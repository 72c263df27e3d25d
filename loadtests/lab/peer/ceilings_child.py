"""The device's copy bandwidth and bf16 GEMM rate, measured in a process of its own before the
engines start (`executor.profiling.device.measure_ceilings`): `python -m
loadtests.lab.peer.ceilings_child OUT`. Without a GPU it writes no ceilings."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> int:
    import torch

    from executor.profiling.device import measure_ceilings

    out = {"ceilings": {}, "device_name": "cpu", "torch": torch.__version__}
    if torch.cuda.is_available():
        device = torch.device("cuda")
        out["ceilings"] = measure_ceilings(device)
        out["device_name"] = torch.cuda.get_device_name(device)
    Path(sys.argv[1]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
