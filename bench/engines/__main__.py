"""`make engines`: the engine checks (vLLM, vLLM's features, fla, DFlash 2's Triton convolution), their verdicts,
and one result file.

    python -m bench.engines --vllm-python .venv-engines/vllm/bin/python --fla-python .venv-engines/fla/bin/python
    python -m bench.engines ... --break layer_ids      # or --break backend, --break conv: the check must FAIL

Writes bench/results/<date>-cpu<cores>-engines.json (-2, -3 ... beside an earlier run; --out to choose): each
check's findings with the engine versions they were verified with. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench.engines import REPO, conv_check, fla_check, pins, vllm_check, vllm_features_check
from dflash.io import unused_path


CHECKS = {"vllm": (vllm_check, "vllm_python", "vllm", "layer_ids"),
          "vllm_features": (vllm_features_check, "vllm_python", "vllm-features", "layer_ids"),
          "fla": (fla_check, "fla_python", "fla", "backend"),
          "conv": (conv_check, "fla_python", "conv", "conv")}
"""name: (module, the argument naming its venv's python, its folder under build/engines, the --break it takes)."""


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engines", description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", required=True, help="python of the vLLM venv")
    parser.add_argument("--fla-python", required=True, help="python of the fla venv")
    parser.add_argument("--out", type=Path, help="result file (default: bench/results/<date>-cpu<cores>-engines.json)")
    parser.add_argument("--only", choices=list(CHECKS), help="run one check")
    parser.add_argument("--break", dest="broken", choices=["layer_ids", "backend", "conv"],
                        help="a deliberate break: layer_ids (vLLM is handed shifted target_layer_ids, and shifted "
                             "layer ids to extract), backend (the fla side reports the fallback's kernels) or conv "
                             "(DFlash 2's Triton convolution ignores block starts)")
    args = parser.parse_args()
    from bench.run import machine

    start = time.time()
    result = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "break": args.broken,
              "pins": {venv: pinned for venv, pinned in pins.PINNED.items()}, "checks": {}}
    verdicts = []
    for name, (module, python, folder, breaks) in CHECKS.items():
        if args.only in (None, name):
            out = module.check(getattr(args, python), REPO / "build" / "engines" / folder,
                               args.broken if args.broken == breaks else None)
            result["checks"][name] = out
            verdicts.append(module.verdict(out))
            print(verdicts[-1], flush=True)
    result["ok"] = all(c["ok"] for c in result["checks"].values())
    result["seconds"] = round(time.time() - start)
    out_path = args.out or unused_path(REPO / "bench" / "results", f"{result['date']}-cpu{os.cpu_count()}-engines"
                                       f"{'-break-' + args.broken if args.broken else ''}")  # never over an earlier run
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"engines: {'PASS' if result['ok'] else 'FAIL'} in {result['seconds']} s; results in {out_path}")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
