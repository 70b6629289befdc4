"""Give the records a device call wrote on an H100 the suffix `-h100` (file and "name"), so that they never
replace the H200's records of the same name: the targets are the H200's, and a call that names nvidia-h200 may
get an H100. gpu_check.sh runs it on the records newer than its start before each bundle.

    python benchmarks/name_by_gpu.py SINCE_FILE [RESULTS_DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(since: str, results: str = "benchmarks/results") -> None:
    start = Path(since).stat().st_mtime
    for path in Path(results).glob("*.json"):
        if path.stat().st_mtime < start or path.stem.endswith("-h100"):
            continue
        record = json.loads(path.read_text())
        if "H100" not in str(record.get("gpu", "")):
            continue
        record["name"] = f"{path.stem}-h100"
        path.with_name(f"{path.stem}-h100.json").write_text(json.dumps(record, indent=2) + "\n")
        path.unlink()
        print(f"{path.name} -> {path.stem}-h100.json (an H100's record)")


if __name__ == "__main__":
    main(*sys.argv[1:])
