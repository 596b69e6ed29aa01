"""NVIDIA Dynamo's standalone KV indexer (ai-dynamo-runtime's `python -m
dynamo.indexer`: ZMQ subscribers fed by vLLM-format KV events, a radix tree
per model, and HTTP `/query`), for `kvcache_testkit::dynamo_indexer`.

Usage: python dynamo_indexer.py LIFETIME_SECONDS [indexer arguments...]

The indexer runs in this process; it ends when the test kills it by process
id, when its standard input closes (the test died), or after LIFETIME_SECONDS
whatever happens.
"""

import os
import sys
import threading
import time


def _exit_when_stdin_closes():
    try:
        while sys.stdin.buffer.read(1):
            pass
    except Exception:
        pass
    os._exit(0)


def _exit_after(seconds):
    time.sleep(seconds)
    print("dynamo_indexer.py: lifetime over, exiting", file=sys.stderr, flush=True)
    os._exit(3)


def main():
    lifetime = float(sys.argv[1])
    threading.Thread(target=_exit_when_stdin_closes, daemon=True).start()
    threading.Thread(target=_exit_after, args=(lifetime,), daemon=True).start()
    from dynamo.llm import run_kv_indexer

    run_kv_indexer(sys.argv[2:])


if __name__ == "__main__":
    main()
