"""The isolate host's WebAssembly worker: runs Wasm modules with wasmtime, inside the host's jail.

Started by host.js (``python3 -I -S wasm_worker.py``; wasmtime from the read-only
``WB_WASMTIME`` dir; up to WB_WASM_WORKERS of them, each given one job at a time), it reads one
JSON job per line on stdin -- ``{"id", "code", "timeout_s", "memory_mb", "max_output"}`` -- and
answers one JSON line on stdout per job, in order. ``code`` is a module as WebAssembly text
(``(module ...)``) or base64 of its binary. Each run is a fresh store:

- a WASI command (exporting ``_start``) runs with no arguments, no environment, no preopened
  directory and no stdin; its stdout and stderr are the run's (bounded by max_output); a nonzero
  ``proc_exit`` is the run's error (``WasiExit``);
- otherwise a ``main`` export taking no parameters is called, and its results are the run's text.

Limits: the store's linear memories and tables are capped at the job's memory_mb (a grow past
it fails; a module whose memory starts past it, or that traps with its memory at the cap, is
``oom``); time by epoch interruption (a timer thread bumps the epoch at the deadline: ``timed_out``)
and fuel (FUEL_PER_S units of fuel per second of timeout: a run that exhausts it is timed out too);
and, should both fail, by the kernel: RLIMIT_CPU is set to the CPU time used so far plus the
timeout and CPU_GRACE_S, so a run past it ends the worker (SIGXCPU; the host reports timed_out).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import resource
import sys
import threading
import time

sys.path.insert(0, os.environ.get("WB_WASMTIME", "/opt/wasmtime"))

import wasmtime

FUEL_PER_S = 2_000_000_000  # fuel units (~wasm instructions) a run may use per second of its timeout
MAX_RUN_S = 3600.0
MAX_TEXT = 64 << 10
WASM_PAGE = 64 << 10
CPU_GRACE_S = 3

config = wasmtime.Config()
config.epoch_interruption = True
config.consume_fuel = True
engine = wasmtime.Engine(config)


class Output:
    """One stream of a run, bounded by the run's max_output (shared by stdout and stderr)."""

    def __init__(self, budget: list[int], truncated: list[bool]) -> None:
        self.parts: list[bytes] = []
        self.budget = budget
        self.truncated = truncated

    def write(self, data: bytes) -> int:
        """Keep what fits; report all of it written (a module retrying a short write would spin)."""
        size = len(data)
        room = self.budget[0]
        if len(data) > room:
            self.truncated[0] = True
            data = data[: max(room, 0)]
        self.budget[0] -= len(data)
        self.parts.append(data)
        return size

    def text(self) -> str:
        return b"".join(self.parts).decode("utf-8", "replace")


def module_bytes(code: str) -> bytes | str:
    text = code.strip()
    if text.startswith("("):
        return text  # WebAssembly text: wasmtime compiles it
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(
            "code must be a WebAssembly module: its text format '(module ...)' or base64 of its binary"
        ) from None


def at_memory_cap(store: wasmtime.Store, instance: wasmtime.Instance | None, cap: int) -> bool:
    if instance is None:
        return False
    for export in instance.exports(store):
        if isinstance(export, wasmtime.Memory) and export.data_len(store) + WASM_PAGE > cap:
            return True
    return False


def run(job: dict) -> dict:
    t0 = time.perf_counter()
    timeout = float(job["timeout_s"]) if float(job["timeout_s"]) > 0 else MAX_RUN_S
    timeout = min(timeout, MAX_RUN_S)
    cap = int(job["memory_mb"]) << 20
    budget, truncated = [max(0, int(job["max_output"]))], [False]
    out, err = Output(budget, truncated), Output(budget, truncated)
    result = {"id": job["id"], "text": None, "error_name": "", "error_value": "", "timed_out": False, "oom": False}
    used = resource.getrusage(resource.RUSAGE_SELF)
    budget_s = int(used.ru_utime + used.ru_stime + timeout) + CPU_GRACE_S
    resource.setrlimit(resource.RLIMIT_CPU, (budget_s, resource.getrlimit(resource.RLIMIT_CPU)[1]))
    store = wasmtime.Store(engine)
    store.set_limits(memory_size=cap, table_elements=1 << 20, instances=16, tables=16, memories=16)
    store.set_fuel(int(FUEL_PER_S * timeout))
    store.set_epoch_deadline(1)
    wasi = wasmtime.WasiConfig()  # no args, env, stdin or preopened directory
    wasi.stdout_custom = out.write
    wasi.stderr_custom = err.write
    store.set_wasi(wasi)
    done = threading.Event()

    def alarm() -> None:
        if not done.wait(timeout):
            engine.increment_epoch()

    timer = threading.Thread(target=alarm, daemon=True)
    instance = None
    try:
        module = wasmtime.Module(engine, module_bytes(job["code"]))
        linker = wasmtime.Linker(engine)
        linker.define_wasi()
        timer.start()
        instance = linker.instantiate(store, module)
        exports = instance.exports(store)
        start = exports.get("_start")
        main = exports.get("main")
        if isinstance(start, wasmtime.Func):
            start(store)
        elif isinstance(main, wasmtime.Func) and not main.type(store).params:
            value = main(store)
            if value is not None:
                result["text"] = repr(value)[:MAX_TEXT]
        else:
            raise ValueError("the module exports neither _start (a WASI command) nor main() without parameters")
    except wasmtime.ExitTrap as e:
        if e.code != 0:
            result["error_name"], result["error_value"] = "WasiExit", f"exit code {e.code}"
    except wasmtime.Trap as e:
        message = str(e)
        if e.trap_code in (wasmtime.TrapCode.INTERRUPT, wasmtime.TrapCode.OUT_OF_FUEL):
            result["timed_out"] = True
        elif at_memory_cap(store, instance, cap):
            result["oom"] = True
            result["error_name"], result["error_value"] = "MemoryLimitError", message[:MAX_TEXT]
        else:
            result["error_name"], result["error_value"] = "Trap", message[:MAX_TEXT]
    except wasmtime.WasmtimeError as e:
        message = str(e)
        if "exceeds memory limits" in message or "resource limit exceeded" in message:
            result["oom"] = True  # its memory or table starts past the sandbox's cap
            result["error_name"] = "MemoryLimitError"
        else:
            result["error_name"] = "CompileError" if instance is None else "WasmError"
        result["error_value"] = message[:MAX_TEXT]
    except ValueError as e:
        result["error_name"], result["error_value"] = "ValueError", str(e)[:MAX_TEXT]
    finally:
        done.set()
    result["stdout"] = out.text()
    result["stderr"] = err.text()
    result["truncated"] = truncated[0]
    result["duration_ms"] = (time.perf_counter() - t0) * 1e3
    return result


def main() -> None:
    for line in sys.stdin:
        try:
            job = json.loads(line)
            reply = run(job)
        except Exception as e:  # a malformed job: the host reports it, the worker goes on
            reply = {"id": -1, "fatal": f"{type(e).__name__}: {e}"[:MAX_TEXT]}
            if isinstance(line, str):
                try:
                    reply["id"] = int(json.loads(line).get("id", -1))
                except (ValueError, AttributeError):
                    pass
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: wasmtime's runtime threads panic in it


if __name__ == "__main__":
    main()
