#!/usr/bin/env bash
# Wheels for a CUDA machine that has torch, transformers and triton but no network (the project's
# H200 machine: Python 3.12, torch 2.11, transformers 5.17): everything else the GPU check needs goes
# into .whl/ (ignored by git), which bench/gpu_check.sh installs from, offline, into .whl/site (a folder
# it puts on PYTHONPATH: the machine's own environment is never written).
#
#   bash bench/prepare_wheels.sh          # here, with network; then carry .whl to the GPU machine
#
# Never downloads torch, triton, transformers or nvidia-* (multi-GB, and already there): the walk
# below follows each wheel's requirements but stops at every package the machine already has
# (DEVICE_HAS, read off the machine's image). Pure-Python sdists (antlr4-python3-runtime) are
# built into wheels here. causal-conv1d is not fetched: it is a CUDA extension built against the
# exact torch it runs with, which cannot happen without a GPU toolchain here; without it
# transformers runs the short depthwise convolution of the Gated DeltaNet layers in PyTorch (fla
# still runs the recurrence), and the kernel report says causal_conv1d=torch_fallback.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
# what is fetched (pinned to what the CPU test suite runs with; fla to a release that supports
# transformers 5.x and triton 3.6). Not wandb: no check uses it (bench/gpu_check.sh sets
# WANDB_MODE=disabled and dflash imports wandb only for a run that logs to W&B), and it was 20 of 25 MB
# and 17 of the dependency wheels.
WANT="hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 gguf==0.19.0
      flash-linear-attention==0.6.0 fla-core==0.6.0"
rm -rf .whl
mkdir -p .whl
"$PY" - $WANT <<'EOF'
import re, subprocess, sys, zipfile
from email.parser import Parser
from pathlib import Path

try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
except ImportError:  # pip vendors packaging
    from pip._vendor.packaging.markers import Marker
    from pip._vendor.packaging.requirements import Requirement

# The H200 image's Python packages (KINDS.md, read 2026-11-17): never fetched.
DEVICE_HAS = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio interface-meta iniconfig jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp""".split()
NEVER = re.compile(r"^(torch|triton|transformers|nvidia-.*|jax.*|tensorflow.*)$")  # even if the list above is stale
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "os_name": "posix", "platform_release": "", "platform_version": "", "implementation_version": "3.12.3",
       "extra": ""}
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
            "--platform", "any"] + [a for n in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_17", "manylinux2014",
                                               "manylinux1") for a in ("--platform", f"{n}_x86_64")]
dest = Path(".whl")
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
have = {norm(n) for n in DEVICE_HAS}
queue, done, there = [Requirement(r) for r in sys.argv[1:]], set(), set()
pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
while queue:
    req = queue.pop(0)
    name = norm(req.name)
    if name in have:
        there.add(str(req.name) + str(req.specifier))
    if name in done or name in have:
        continue
    if NEVER.match(name):
        sys.exit(f"prepare_wheels: {name} is required (by the chain from {sys.argv[1:]}) but is one of the "
                 f"packages the GPU machine must bring itself; refusing to download it")
    done.add(name)
    before = set(dest.iterdir())
    spec = str(req.name) + str(req.specifier)
    got = subprocess.run(pip + ["download", "--no-deps", *PLATFORM, "-d", str(dest), spec], capture_output=True,
                         text=True)
    if got.returncode:  # no wheel on the index: build one from the sdist (pure-Python packages only)
        print(f"  {spec}: no wheel on the index, building one from its sdist")
        if subprocess.run(pip + ["wheel", "--no-deps", "-w", str(dest), spec]).returncode:
            sys.exit(f"prepare_wheels: {spec} has no wheel and its sdist does not build:\n{got.stderr}")
    new = [p for p in set(dest.iterdir()) - before if p.suffix == ".whl"]
    if len(new) != 1:
        sys.exit(f"prepare_wheels: expected one new wheel for {spec}, got {new}")
    if got.returncode and not new[0].name.endswith("-py3-none-any.whl"):
        sys.exit(f"prepare_wheels: {new[0].name} was built here and is not pure Python: it would not run there")
    with zipfile.ZipFile(new[0]) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        requires = Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []
    print(f"  {new[0].name}")
    for line in requires:
        r = Requirement(line)
        if r.marker is None or r.marker.evaluate(ENV):
            queue.append(r)
print("required but already on the GPU machine (not fetched; its versions must satisfy these):")
print("  " + " ".join(sorted(there)))
EOF
echo "causal-conv1d: not fetched (a CUDA extension; cannot be built here): the GPU check runs with its torch fallback"
echo ".whl: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1)"
