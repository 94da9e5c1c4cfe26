"""`vllm bench serve`, several times in one process, against a running server; run in the vLLM venv.

    python bench/engines/vllm_load.py runs.json answer.json

runs.json: {"runs": [[arg, ...], ...]}, each the arguments of one `vllm bench serve` command line (what follows
`vllm bench serve`). Each is parsed by vLLM's own parser (`vllm.benchmarks.serve.add_cli_args`) and run by its own
`main`, the client the command runs: requests over HTTP to the server, vLLM's result dict back (output tokens/s,
TPOT, and the speculative acceptance it reads from the server's /metrics). One process for all of them because
importing vLLM's benchmark takes 15-20 s on 2 cores, as long as a short run itself. answer.json is rewritten after
each run: {"versions", "results": [the result dict or {"error": ...} per run]}; a failed run stops the rest (the
caller says why in one line). CLIENT_CPUS (e.g. "1"): the cores it runs on. Imports vLLM, vllm_cli.py and the
standard library only.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main() -> None:
    if os.environ.get("CLIENT_CPUS"):  # the core(s) the caller keeps for the client, away from the engine's threads
        os.sched_setaffinity(0, {int(c) for c in os.environ["CLIENT_CPUS"].split(",")})
    import vllm_cli  # beside this file (its folder is sys.path[0]): vLLM's code asks for the "vllm" version
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    runs = json.loads(open(sys.argv[1]).read())["runs"]
    answer = {"versions": {d: vllm_cli.version(d) for d in ("vllm", "torch", "transformers")}, "results": []}
    for argv in runs:
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        try:
            result = bench_serve(parser.parse_args(argv))
        except (Exception, SystemExit) as e:  # the caller names the run and the reason
            answer["results"].append({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]})
        else:
            answer["results"].append({k: v for k, v in result.items() if not isinstance(v, list)
                                      or k == "spec_decode_per_position_acceptance_rates"})
        with open(sys.argv[2], "w") as f:
            json.dump(answer, f, indent=1)
        if "error" in answer["results"][-1]:
            sys.exit(3)


if __name__ == "__main__":
    main()
