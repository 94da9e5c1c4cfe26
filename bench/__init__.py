"""dflash benchmarks: `python -m bench [--quick]`."""
