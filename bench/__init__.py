"""dflash benchmarks: `python -m bench [--quick]`. The GPU check is bench/gpu/ (`bash bench/gpu_check.sh`), the
real engines in the loop bench/engines/ (`make engines`)."""
