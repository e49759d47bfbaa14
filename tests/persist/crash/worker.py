"""A process the crash harness starts and SIGKILLs: `python -m crash.worker CONFIG_JSON` (crash/ on sys.path's
`tests/persist`).

Modes (`config["mode"]`):
- "inproc": opens (or restores) the durable store and runs the writer, updater, consumer and checkpoint threads of
  `crash.workload` on it, all in this process.
- "server": opens (or restores) the store, serves it (`ab.serve(store, "grpc://127.0.0.1:0")`) and checkpoints it
  every 0.2-0.8 s; its "open" line carries the location.
- "client": connects to `config["location"]` (a connection per thread) and runs the writer, updater and consumer
  threads against the served store.

Every process logs to its own side log (`crash.workload.SideLog`) and runs until it is killed. A watchdog exits it
(status 3) if the harness that started it is gone or after `config["max_s"]` seconds, so a failed test leaves no
process behind.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from crash import workload as wl


def _watchdog(max_s: float) -> None:
    parent = os.getppid()
    end = time.monotonic() + max_s
    while time.monotonic() < end and os.getppid() == parent:
        time.sleep(0.2)
    os._exit(3)


def main(config: dict) -> None:
    threading.Thread(target=_watchdog, args=(float(config.get("max_s", 300)),), daemon=True).start()
    variant = wl.VARIANTS[config["variant"]]
    gen, seed, mode = int(config["gen"]), int(config["seed"]), config["mode"]
    log = wl.SideLog(config["log"], gen)
    shared = wl.Shared()
    if mode in ("inproc", "server"):
        store = wl.open_store(config["dir"], variant, config["policy"])
        st = store.stats()
        opened = {"hi": int(st["next_seq"]), "n": len(store), "pv": int(store.policy_version)}
        if mode == "server":
            import arrowbuf as ab

            server = ab.serve(store, "grpc://127.0.0.1:0")
            opened["loc"] = server.location
        log(op="open", ph="d", **opened)
        threading.Thread(target=wl.guarded, args=(wl.checkpointer, log, store, log, shared, seed), daemon=True).start()
        if mode == "inproc":
            wl.client_threads(lambda: store, log, variant, gen, shared, seed)
    else:
        import arrowbuf as ab

        def connect():
            return ab.connect(config["location"], timeout=30)

        wl.client_threads(connect, log, variant, gen, shared, seed)
        log(op="ready", ph="d")
    while True:  # until SIGKILL (or the watchdog)
        time.sleep(3600)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
